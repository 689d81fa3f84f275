"""The parity check run after every export: onnxruntime vs PyTorch logits on random inputs.

A prefill (empty past) followed by several decode steps, each side feeding back its own KV cache, so the
error that accumulates through the cache is measured too. Fails loudly above the tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from crosstrain.kernels import registry as kernel_registry
from crosstrain.models.gpt import GPT
from crosstrain.plugins.export.errors import ParityError


@dataclass
class ParityReport:
    """Max abs logit error between onnxruntime and PyTorch, over the prefill and the decode steps."""

    label: str
    tolerance: float
    max_abs_err: float
    max_abs_err_prefill: float
    max_abs_err_decode: float
    max_abs_err_cache: float
    batch: int
    prefill_len: int
    decode_steps: int
    passed: bool
    batches: int = 1
    bound: str = "fixed"  # "fixed": ``tolerance`` was given; "derived": per step, see check_integer_parity

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        over = f"{self.batches} batches, " if self.batches > 1 else ""
        limit = (f"within the derived bound (worst step: error {self.max_abs_err:.3g} <= {self.tolerance:.3g})"
                 if self.bound == "derived" else f"tolerance {self.tolerance:g}")
        return (f"max abs logit error {self.max_abs_err:.3g} ({over}prefill {self.max_abs_err_prefill:.3g}, "
                f"{self.decode_steps} decode steps {self.max_abs_err_decode:.3g}, kv cache "
                f"{self.max_abs_err_cache:.3g}), {limit}: {verdict}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _feeds(ids: torch.Tensor, past: list[np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids.numpy().astype(np.int64)}
    for i in range(len(past) // 2):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    return feeds


def _step_sizes(batch: int, prefill_len: int, decode_steps: int) -> list[int]:
    """A prefill, then single tokens, then one 3-token chunk (a chunked prefill on a non-empty past)."""
    return [prefill_len] + [1] * max(decode_steps - 1, 0) + ([3] if decode_steps > 0 else [])


@dataclass
class _Errors:
    prefill: float = 0.0
    decode: float = 0.0
    cache: float = 0.0
    ratio: float = 0.0  # worst error / bound over the steps
    worst: float = 0.0  # the error at that step
    bound: float = 0.0  # the bound at that step


def _run_case(model: GPT, session: object, ids: torch.Tensor, widths: list[int], gen: torch.Generator,
              bound: Callable[[torch.Tensor, torch.Tensor], float], errs: _Errors) -> None:
    """Prefill ``ids`` then ``widths[1:]`` random tokens, each side feeding back its own KV cache; ``bound(ids,
    logits)`` gives each step's limit (called once per step, in order)."""
    from crosstrain.plugins.export.runtime import run

    cfg = model.config
    batch = ids.shape[0]
    empty = np.zeros((batch, cfg.kv_heads, 0, cfg.head_dim), dtype=np.float32)
    ort_past = [empty] * (2 * cfg.n_layers)
    torch_past = None
    for step, width in enumerate(widths):
        if step > 0:
            ids = torch.randint(0, cfg.vocab_size, (batch, width), generator=gen)
        logits, torch_past = model.forward_with_cache(ids, torch_past)
        limit = bound(ids, logits)
        outs = run(session, _feeds(ids, ort_past))
        err = float(np.abs(outs[0] - logits.numpy()).max())
        flat = [t for kv in torch_past for t in kv]
        cache_errs = (float(np.abs(o - t.numpy()).max()) for o, t in zip(outs[1:], flat, strict=True))
        errs.cache = max(errs.cache, *cache_errs)
        if step == 0:
            errs.prefill = max(errs.prefill, err)
        else:
            errs.decode = max(errs.decode, err)
        ratio = err / limit if limit > 0 else (0.0 if err == 0 else float("inf"))
        if not np.isfinite(err):
            ratio = float("inf")
        if ratio >= errs.ratio:
            errs.ratio, errs.worst, errs.bound = ratio, err, limit
        ort_past = list(outs[1:])


def check_parity(
    model: GPT,
    onnx_path: str | os.PathLike[str],
    *,
    tolerance: float = 1e-4,
    seed: int = 0,
    batch: int = 2,
    prefill_len: int = 8,
    decode_steps: int = 4,
    label: str = "fp32",
    raise_on_fail: bool = True,
) -> ParityReport:
    """Compare ``model`` with the ONNX graph at ``onnx_path``; raise :class:`ParityError` above ``tolerance``."""
    from crosstrain.plugins.export.runtime import make_session

    cfg = model.config
    prefill_len = max(1, min(prefill_len, cfg.max_seq_len - decode_steps - 3))
    session = make_session(onnx_path)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, prefill_len), generator=gen)
    widths = _step_sizes(batch, prefill_len, decode_steps)
    errs = _Errors()
    with kernel_registry.use_reference(), torch.no_grad():
        _run_case(model, session, ids, widths, gen, lambda *_: tolerance, errs)
    worst = max(errs.prefill, errs.decode)
    ok = bool(np.isfinite(worst)) and worst <= tolerance
    report = ParityReport(label, tolerance, worst, errs.prefill, errs.decode, errs.cache, batch, prefill_len,
                          len(widths) - 1, ok)
    if not ok and raise_on_fail:
        raise ParityError(f"ONNX {label} parity check failed: {report.describe()}; nothing was written "
                          "(raise the tolerance with --tolerance only if this error is acceptable)")
    return report
