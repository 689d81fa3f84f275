"""Rollouts: G completions per prompt from the current policy, packed for the training forward.

Sampling is reproducible and layout-independent: each optimizer step draws one 63-bit seed from the recipe's
checkpointed generator (the same on every rank), and each prompt's ``G`` completions take their sampling noise
from a generator seeded with that seed and the prompt's index in the training set (:func:`prompt_noise`; a step
never holds a prompt twice: the sampler takes a step from one epoch's permutation). A micro-batch samples in one
batched ``generate`` call by inverse CDF of that per-row noise, so a prompt's completions are the same whatever
rank and micro-batch it lands in: a resumed run samples what the uninterrupted one did, and any layout what one
process with the same ``grad_accum`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.generation import GenerationConfig, GenerationOutput, generate

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): spreads prompt indices over seeds
_MASK = (1 << 63) - 1


class SamplingRNG:
    """The checkpointed sampling generator (recipe ``state()``): one seed per optimizer step."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(int(seed))

    def next_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"].to(torch.uint8))


def prompt_noise(step_seed: int, prompts: list[int], group: int, steps: int) -> torch.Tensor:
    """Uniform sampling noise ``[len(prompts) * group, steps]`` (CPU): rows ``group*k ... group*k + group-1`` from
    a generator seeded with the step's seed and prompt ``prompts[k]``'s index, so no two prompts of a step share
    noise and a prompt's noise does not depend on where in the step it is sampled."""
    rows = [torch.rand((group, steps), generator=torch.Generator().manual_seed((step_seed + (i + 1) * _MIX) & _MASK))
            for i in prompts]
    return torch.cat(rows) if rows else torch.zeros((0, steps))


@dataclass
class Packed:
    """Prompts + completions right-padded for a plain causal forward (real tokens never see the padding):
    ``ids [R, W]``; ``index [R, T]`` the logit positions that predict completion token t; ``tokens``, ``mask``,
    ``logprobs [R, T]`` from the engine; ``ends [R]`` the position of each row's last real token."""

    ids: torch.Tensor
    index: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    ends: torch.Tensor
    stopped: torch.Tensor  # [R] bool: ended with the stop token (not cut at max_new_tokens)


def pack(out: GenerationOutput, prompts: list[list[int]], config: GenerationConfig, width: int = 0) -> Packed:
    """The engine's left-padded output as right-padded rows, completions padded to ``max_new_tokens`` and rows to
    ``width`` (at least the longest prompt + ``max_new_tokens``)."""
    device = out.tokens.device
    t_max = config.max_new_tokens
    pad = (0, t_max - out.tokens.shape[1])
    tokens = F.pad(out.tokens, pad, value=config.pad_token)
    mask = F.pad(out.mask, pad, value=False)
    logprobs = F.pad(out.logprobs, pad, value=0.0)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = max(width, int(lengths.max()) + t_max)
    ids = torch.full((len(prompts), width), config.pad_token, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    cols = lengths.unsqueeze(1) + torch.arange(t_max, device=device)
    ids.scatter_(1, cols, tokens)
    n_new = mask.sum(1)
    last = tokens.gather(1, (n_new - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stops = torch.tensor(config.stop_tokens, dtype=torch.long, device=device)
    stopped = (n_new > 0) & torch.isin(last, stops) if len(stops) else torch.zeros_like(n_new, dtype=torch.bool)
    return Packed(ids=ids, index=cols - 1, tokens=tokens, mask=mask, logprobs=logprobs,
                  ends=lengths + n_new - 1, stopped=stopped)


def sample(policy: nn.Module, prompts: list[np.ndarray], group: int, config: GenerationConfig,
           noise: torch.Tensor, width: int = 0) -> Packed:
    """``group`` completions of each prompt in one batched call (rows ``group*k ... group*k + group-1`` are
    prompt ``k``'s), drawn from ``noise`` (:func:`prompt_noise`) and packed to ``width`` (:func:`pack`)."""
    rows = [p.tolist() for p in prompts for _ in range(group)]
    return pack(generate(policy, rows, config, noise=noise), rows, config, width)


def completion_logits(model: nn.Module, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The model's logits ``[R, T, V]`` at the positions that predict each completion token."""
    logits = model(ids[:, :-1])
    return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))


def completion_texts(tokens: torch.Tensor, mask: torch.Tensor, stopped: torch.Tensor, tokenizer: Any) -> list[str]:
    """Each completion decoded, without its stop token."""
    out = []
    for row, n, s in zip(tokens.tolist(), mask.sum(1).tolist(), stopped.tolist(), strict=True):
        out.append(tokenizer.decode(np.asarray(row[: n - 1 if s else n], dtype=np.int64)))
    return out
