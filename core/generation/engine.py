"""Batched generation on the cache protocol: left-padded ragged prompts, one prefill, one forward per new token.

The cache protocol (the built-in GPT implements it; any model may):

- ``model.allocate_kv_cache(batch, max_len, dtype=None, device=None) -> cache`` with an integer ``cache.length``
  (slots filled, the same for every row);
- ``model.forward_cached(tokens [B, L], positions [B, L], cache, attention_mask [B, cache.length + L] | None)
  -> logits [B, L, vocab]`` writes the new keys/values at slots ``[cache.length, cache.length + L)`` in place,
  advances ``cache.length`` by ``L``, and attends from each new token to the real (``attention_mask`` True;
  ``None``: all) tokens not in its future. ``positions`` are per-row token positions: 0 at each row's first real
  prompt token.

With ``GenerationConfig(compile=True)`` the cache must also offer ``make_static()`` (after which ``forward_cached``
takes ``attention_mask [B, max_len]`` and reads the whole buffers, advancing a device-side position, so every
decode step has the same shapes and Python state) and each decode step runs through ``torch.compile``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.generation.config import GenerationConfig, GenerationOutput
from crosstrain.generation.sampling import next_tokens, token_logprobs
from crosstrain.generation.sharded import gathered, model_device, unwrap


def left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, P]`` right-aligned (left-padded with ``pad``) and the ``[B, P]`` bool mask of real tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = True
    return ids.to(device), mask.to(device)


def _decode_step(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: object,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
    forward = cast(Callable[..., torch.Tensor], model.forward_cached)
    return forward(tokens, positions, cache, attention_mask)[:, -1]


@functools.cache
def _compiled_step() -> Callable[..., torch.Tensor]:
    """``_decode_step`` compiled once per process; dynamo keeps one graph per shape (``dynamic=False``: shapes are
    static by construction, so nothing is traced symbolically)."""
    return torch.compile(_decode_step, fullgraph=True, dynamic=False)


def _check(model: nn.Module, prompts: list[list[int]], config: GenerationConfig) -> None:
    if config.compile:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ConfigError("GenerationConfig(compile=True) needs an unsharded model (FSDP2/TP parameters are "
                              "DTensors); use compile=False for sharded models")
    for name in ("allocate_kv_cache", "forward_cached"):
        if not callable(getattr(model, name, None)):
            raise ConfigError(f"{type(model).__name__} has no {name}(); generation needs a model implementing the "
                              "cache protocol (see crosstrain.generation.engine), such as crosstrain's GPT")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token; drop empty prompts or prepend a BOS token")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    ids = [t for p in prompts for t in p] + list(config.stop_tokens) + [config.pad_token]
    if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
        raise ConfigError(f"prompt, stop and pad token ids must lie in [0, {vocab}) (the model's vocab_size)")


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], config: GenerationConfig,
             generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> GenerationOutput:
    """Continue each prompt by up to ``config.max_new_tokens`` tokens; rows are independent of each other.

    Sampling draws from ``generator`` (on the model's device), so a seeded generator reproduces the output; or,
    with ``noise [B, max_new_tokens]`` (uniforms in ``[0, 1)``), row ``b``'s token ``t`` is the inverse-CDF draw
    of ``noise[b, t]`` (:func:`~crosstrain.generation.sampling.inverse_cdf`), so a row's completion depends on its
    own noise only, not on the other rows of the batch. For
    FSDP2, TP and DDP models see :mod:`crosstrain.generation.sharded` (what is gathered, and its memory).
    """
    core = unwrap(model)
    _check(core, prompts, config)
    device = model_device(core)
    ids, prompt_mask = left_pad(prompts, config.pad_token, device)
    batch, width = ids.shape
    steps = config.max_new_tokens
    if noise is not None:
        if tuple(noise.shape) != (batch, steps):
            raise ConfigError(f"noise has shape {tuple(noise.shape)}; pass one uniform per row and new token, "
                              f"[{batch}, {steps}]")
        noise = noise.to(device)
    key_mask = torch.ones((batch, width + steps), dtype=torch.bool, device=device)
    key_mask[:, :width] = prompt_mask
    prompt_lens = prompt_mask.sum(1)
    padded = len({len(p) for p in prompts}) > 1  # equal-length prompts decode with no mask at all
    tokens = torch.full((batch, steps), config.pad_token, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    mask = torch.zeros((batch, steps), dtype=torch.bool, device=device)
    stops = torch.tensor(config.stop_tokens, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    ran = 0
    if steps:
        with gathered(core):
            cache = core.allocate_kv_cache(batch, width + steps, None, device)
            positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
            logits = core.forward_cached(ids, positions, cache, prompt_mask if padded else None)[:, -1]
            step: Callable[..., torch.Tensor] = _decode_step
            if config.compile:  # the whole buffer under a mask from here on: one graph for every step
                if not callable(getattr(cache, "make_static", None)):
                    raise ConfigError(f"{type(cache).__name__} has no make_static(); GenerationConfig(compile=True) "
                                      "needs a static-shape cache (see crosstrain.generation.engine)")
                cache.make_static()
                step = _compiled_step()
            for t in range(steps):
                nxt = next_tokens(logits, greedy=config.greedy, temperature=config.temperature, top_k=config.top_k,
                                  top_p=config.top_p, generator=generator,
                                  uniform=None if noise is None else noise[:, t])
                nxt = torch.where(alive, nxt, config.pad_token)
                tokens[:, t] = nxt
                logprobs[:, t] = token_logprobs(logits, nxt).masked_fill(~alive, 0.0)
                mask[:, t] = alive
                ran = t + 1
                if len(stops):
                    alive &= ~torch.isin(nxt, stops)
                    if not bool(alive.any()):  # every row stopped; (a host sync, only with stop tokens)
                        break
                if t + 1 < steps:
                    visible = key_mask if config.compile else key_mask[:, :width + t + 1]
                    logits = step(core, nxt.unsqueeze(1), (prompt_lens + t).unsqueeze(1), cache,
                                  visible if padded else None)
    tokens, logprobs, mask = tokens[:, :ran], logprobs[:, :ran], mask[:, :ran]
    return GenerationOutput(sequences=torch.cat((ids, tokens), dim=1), prompt_mask=prompt_mask, tokens=tokens,
                            logprobs=logprobs, mask=mask, lengths=mask.sum(1))
