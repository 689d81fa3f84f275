"""Greedy and sampled generation with a KV cache, on PyTorch or onnxruntime, behind one small interface.

Both engines run the same computation (the reference kernels of the GPT, a prefill over the prompt and one
forward per new token feeding back the cache) so greedy decoding yields identical tokens. The torch engine
generates with :func:`crosstrain.generation.generate` (the GPT's static KV cache); the onnxruntime engine runs its
own loop here, feeding back the exported graph's ``present`` arrays. Both pick tokens with
``crosstrain.generation.sampling`` from one seeded generator, so a seed gives the same tokens on either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from crosstrain.generation import GenerationConfig
from crosstrain.generation import generate as generate_tokens
from crosstrain.generation.cache import StaticKVCache
from crosstrain.generation.sampling import next_tokens
from crosstrain.kernels import registry as kernel_registry
from crosstrain.models.gpt import GPT, GPTConfig
from crosstrain.plugins.export.errors import ExportError
from crosstrain.plugins.export.placement import HOST, Placement, inference_placement
from crosstrain.plugins.export.runtime import run


class Engine(Protocol):
    """Runs ``input_ids [B, T]`` on top of an opaque cache; returns ``[B, T, vocab]`` fp32 logits (host arrays) and
    the new cache. ``placement`` says where it computes."""

    config: GPTConfig
    tokenizer: dict[str, Any]
    placement: Placement

    def forward(self, ids: np.ndarray, cache: Any) -> tuple[np.ndarray, Any]: ...

    def empty_cache(self, batch: int, max_len: int | None = None) -> Any: ...


class TorchEngine:
    """PyTorch eager on the GPT's static KV cache (``forward_cached``, reference kernels like the exported graph).

    ``forward_torch`` also takes the concatenating ``forward_with_cache`` layout (``None`` or a list of per-layer
    ``(k, v)``), which is what the exported ONNX graph computes; benchmarks/export.py compares the two that way.
    """

    def __init__(self, model: GPT, tokenizer: dict[str, Any] | None = None, config: Any = None,
                 placement: Placement | None = None) -> None:
        """``placement``: where to compute (the model is moved there); None is the process's backend
        (:func:`~crosstrain.plugins.export.placement.inference_placement`)."""
        from crosstrain.plugins.export.loading import tokenizer_metadata

        self.placement = placement or inference_placement()
        self.model = model.to(self.placement.device).eval()
        self.config = config if config is not None else model.config  # a generic model: its GenericConfig
        self.tokenizer = tokenizer or tokenizer_metadata(model.config)

    def empty_cache(self, batch: int, max_len: int | None = None) -> StaticKVCache:
        return self.model.allocate_kv_cache(batch, max_len or self.config.max_seq_len)

    def forward_torch(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        with kernel_registry.use_reference(), torch.inference_mode():
            if not isinstance(cache, StaticKVCache):
                return self.model.forward_with_cache(ids, cache)
            batch, length = ids.shape
            positions = torch.arange(cache.length, cache.length + length, device=ids.device).expand(batch, length)
            return self.model.forward_cached(ids, positions, cache, None), cache  # equal-length rows: no padding

    def forward(self, ids: np.ndarray, cache: Any) -> tuple[np.ndarray, Any]:
        ids_t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.placement.device)
        logits, cache = self.forward_torch(ids_t, cache)
        return logits.float().to("cpu").numpy(), cache  # an accelerator's logits reach the host by an explicit copy

    def generate(self, rows: list[list[int]], max_new_tokens: int, sampling: Sampling, stops: tuple[int, ...],
                 generator: torch.Generator) -> list[list[int]]:
        """Each row's new tokens (up to and including its first of ``stops``) from
        :func:`crosstrain.generation.generate`."""
        config = GenerationConfig(max_new_tokens=max_new_tokens, greedy=sampling.temperature <= 0,
                                  temperature=sampling.temperature or 1.0, top_k=sampling.top_k, top_p=sampling.top_p,
                                  stop_tokens=stops)
        with kernel_registry.use_reference(), torch.inference_mode():
            out = generate_tokens(self.model, rows, config, generator)
        return [row[:n] for row, n in zip(out.tokens.tolist(), out.lengths.tolist(), strict=True)]


class OrtEngine:
    """onnxruntime on an exported model; the cache is the list of ``present`` arrays fed back as ``past``."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None, session: Any = None) -> None:
        from crosstrain.plugins.export.runtime import make_session, read_metadata

        self.path = str(path)
        self.placement = HOST
        self.session = session if session is not None else make_session(path, threads)
        self.config, self.tokenizer = read_metadata(self.session)
        self._past_names = [i.name for i in self.session.get_inputs()][1:]
        if len(self._past_names) != 2 * self.config.n_layers:
            raise ExportError(f"{path} has {len(self._past_names)} cache inputs, expected {2 * self.config.n_layers}; "
                              "re-export it with `crosstrain export`")

    def empty_cache(self, batch: int, max_len: int | None = None) -> list[np.ndarray]:
        cfg = self.config
        empty = np.zeros((batch, cfg.kv_heads, 0, cfg.head_dim), dtype=np.float32)
        return [empty] * (2 * cfg.n_layers)

    def forward(self, ids: np.ndarray, cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64)}
        feeds.update(zip(self._past_names, cache, strict=True))
        outs = run(self.session, feeds)
        return outs[0], outs[1:]


# -- tokenizer ----------------------------------------------------------------------------------------------------
def _hf_tokenizer(tokenizer: dict[str, Any]) -> Any:
    from crosstrain.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(tokenizer["path"])


def encode(tokenizer: dict[str, Any], text: str) -> list[int]:
    if tokenizer.get("type") == "hf":  # a tokenizer.json folder (data.tokenizer, or a Hugging Face model's own)
        return [int(i) for i in _hf_tokenizer(tokenizer).encode(text)]
    if tokenizer.get("type") != "byte":
        raise ExportError(f"this model has no byte tokenizer (vocab {tokenizer.get('vocab_size')}); "
                          "pass token ids with --prompt-ids instead of --prompt")
    return list(text.encode(tokenizer.get("encoding", "utf-8")))


def decode(tokenizer: dict[str, Any], ids: list[int]) -> str:
    if tokenizer.get("type") == "hf":
        return str(_hf_tokenizer(tokenizer).decode(ids))
    if tokenizer.get("type") != "byte":
        return " ".join(str(i) for i in ids)
    return bytes(i for i in ids if 0 <= i < 256).decode(tokenizer.get("encoding", "utf-8"), errors="replace")


# -- sampling -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy (argmax); otherwise softmax sampling with optional top-k / top-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ExportError(f"--temperature must be a number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ExportError(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ExportError(f"--top-p must lie in (0, 1] (1 = no limit), got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ExportError(f"--seed must be >= 0, got {self.seed}")


def pick(logits: np.ndarray, sampling: Sampling, generator: torch.Generator) -> np.ndarray:
    """Next token per row of ``logits [B, vocab]`` (:func:`crosstrain.generation.sampling.next_tokens`)."""
    return next_tokens(torch.from_numpy(np.asarray(logits)), greedy=sampling.temperature <= 0,
                       temperature=sampling.temperature or 1.0, top_k=sampling.top_k, top_p=sampling.top_p,
                       generator=generator).numpy()


def check_length(cfg: GPTConfig, prompt_len: int, max_new_tokens: int) -> None:
    """Raise a one-line error when the prompt plus the new tokens do not fit the model's context."""
    if prompt_len < 1:
        raise ExportError("the prompt is empty; give at least one token")
    if max_new_tokens < 0:
        raise ExportError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if prompt_len + max_new_tokens > cfg.max_seq_len:
        raise ExportError(f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} = "
                          f"{prompt_len + max_new_tokens} exceeds the model's max_seq_len {cfg.max_seq_len}; "
                          "shorten the prompt or lower --max-new-tokens")


def generate(
    engine: Engine,
    prompt: list[int] | list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    eos_id: int | None = None,
) -> list[list[int]]:
    """Generate ``max_new_tokens`` after each prompt (equal-length prompts form one batch); returns new tokens, each
    row up to and including its first stop token: ``eos_id`` and the engine tokenizer's stop set
    (:func:`stop_set`)."""
    sampling = sampling or Sampling()
    if not prompt or not all(len(r) if isinstance(r, list) else True for r in prompt):
        raise ExportError("the prompt is empty; give at least one token")
    rows = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    if not rows or len({len(r) for r in rows}) != 1:  # type: ignore[arg-type]
        raise ExportError("prompts in one batch must have the same length")
    ids = np.asarray(rows, dtype=np.int64)
    cfg = engine.config
    check_length(cfg, ids.shape[1], max_new_tokens)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ExportError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    generator = engine.placement.generator(sampling.seed)  # on the device where the logits are sampled
    stops = stop_set(engine.tokenizer, eos_id)
    if isinstance(engine, TorchEngine):
        return engine.generate(ids.tolist(), max_new_tokens, sampling, stops, generator)
    return _ort_loop(engine, ids, max_new_tokens, sampling, stops, generator)


def stop_set(tokenizer: dict[str, Any], eos_id: int | None = None) -> tuple[int, ...]:
    """The stop tokens of a model's tokenizer metadata (:func:`crosstrain.generation.stops.stop_tokens` of its
    folder, which for a Hugging Face model is the model folder with its ``generation_config.json``) and ``eos_id``."""
    from crosstrain.generation.stops import stop_tokens

    extra = () if eos_id is None else (int(eos_id),)
    if tokenizer.get("type") != "hf" or not tokenizer.get("path"):
        return extra
    return stop_tokens(str(tokenizer["path"]), extra=extra)


def _ort_loop(engine: Engine, ids: np.ndarray, max_new_tokens: int, sampling: Sampling, stops: tuple[int, ...],
              generator: torch.Generator) -> list[list[int]]:
    """Prefill, then one forward per new token feeding back the engine's cache; a row ends after its first stop."""
    cache = engine.empty_cache(ids.shape[0], ids.shape[1] + max_new_tokens)
    out: list[np.ndarray] = []
    done = np.zeros(ids.shape[0], dtype=bool)
    step_ids = ids
    for i in range(max_new_tokens):
        logits, cache = engine.forward(step_ids, cache)
        nxt = pick(logits[:, -1, :], sampling, generator).astype(np.int64)
        out.append(nxt)
        if stops:
            done |= np.isin(nxt, stops)
            if done.all():
                break
        if i + 1 < max_new_tokens:
            step_ids = nxt[:, None]
    if not out:
        return [[] for _ in range(ids.shape[0])]
    rows = np.stack(out, axis=1).tolist()
    ends = [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in rows]
    return [row[:n] for row, n in zip(rows, ends, strict=True)]
