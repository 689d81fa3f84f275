"""The parity check run after every export: onnxruntime vs PyTorch logits on random inputs.

A prefill (empty past) followed by several decode steps, each side feeding back its own KV cache, so the
error that accumulates through the cache is measured too. Fails loudly above the tolerance.
"""

from __future__ import annotations

import os
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

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (f"max abs logit error {self.max_abs_err:.3g} (prefill {self.max_abs_err_prefill:.3g}, "
                f"{self.decode_steps} decode steps {self.max_abs_err_decode:.3g}, kv cache "
                f"{self.max_abs_err_cache:.3g}), tolerance {self.tolerance:g}: {verdict}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _feeds(ids: torch.Tensor, past: list[np.ndarray]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids.numpy().astype(np.int64)}
    for i in range(len(past) // 2):
        feeds[f"past_key_values.{i}.key"] = past[2 * i]
        feeds[f"past_key_values.{i}.value"] = past[2 * i + 1]
    return feeds


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
    from crosstrain.plugins.export.runtime import make_session, run

    cfg = model.config
    prefill_len = max(1, min(prefill_len, cfg.max_seq_len - decode_steps - 3))
    session = make_session(onnx_path)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, prefill_len), generator=gen)
    empty = np.zeros((batch, cfg.kv_heads, 0, cfg.head_dim), dtype=np.float32)
    ort_past = [empty] * (2 * cfg.n_layers)
    torch_past = None
    err_prefill = err_decode = err_cache = 0.0
    # decode steps: single tokens, plus one 3-token chunk (a chunked prefill on a non-empty past)
    chunks = [1] * max(decode_steps - 1, 0) + ([3] if decode_steps > 0 else [])
    with kernel_registry.use_reference(), torch.no_grad():
        for step, width in enumerate([prefill_len, *chunks]):
            if step > 0:
                ids = torch.randint(0, cfg.vocab_size, (batch, width), generator=gen)
            logits, torch_past = model.forward_with_cache(ids, torch_past)
            outs = run(session, _feeds(ids, ort_past))
            err = float(np.abs(outs[0] - logits.numpy()).max())
            flat = [t for kv in torch_past for t in kv]
            cache_errs = (float(np.abs(o - t.numpy()).max()) for o, t in zip(outs[1:], flat, strict=True))
            err_cache = max(err_cache, max(cache_errs))
            if step == 0:
                err_prefill = err
            else:
                err_decode = max(err_decode, err)
            ort_past = list(outs[1:])
    worst = max(err_prefill, err_decode)
    ok = bool(np.isfinite(worst)) and worst <= tolerance
    report = ParityReport(label, tolerance, worst, err_prefill, err_decode, err_cache, batch, prefill_len,
                          len(chunks), ok)
    if not ok and raise_on_fail:
        raise ParityError(f"ONNX {label} parity check failed: {report.describe()}; nothing was written "
                          "(raise the tolerance with --tolerance only if this error is acceptable)")
    return report
