"""The parity gate of an integer export: onnxruntime against :func:`~.int_model.ort_reference` (PyTorch computing
the same integer ops, :mod:`.int_reference`) on 8 batches of random ids, from one token to a 256-token prompt, each
followed by decode steps that feed back each side's own KV cache.

The bound, derived per step (``tolerance`` replaces it by a fixed number). Let ``R`` be the reference's logits,
``O`` onnxruntime's and ``F`` those of the same model with the same integer weights but float activations. Both
sides compute the same integers from the same weights (the integer sums are exact on both), so they differ by

1. fp32 rounding in the float parts (norms, rotary, attention, the rescale of integer sums) summed in another
   order: what the fp32 export's gate bounds, ``DEFAULT_TOLERANCE`` (1e-4);
2. rounding flips: where an activation quantiser's float input lies within that fp32 error of a rounding boundary
   (or of the max that sets a per-tensor scale), the two sides pick adjacent integers, and the change reaches every
   later quantiser (a flip in the first layer of a 2-layer model moved 980 of the head's 1024 inputs by a step).
   After a flip the two sides are two roundings of the same activations, each within half a step of the float
   value (plus the fp32 error): onnxruntime's rounding error is of the reference's size, ``|O - F| <= |R - F|``
   to first order, and by the triangle inequality ``|O - R| <= |O - F| + |F - R| <= 2 |R - F|``.

So each step must satisfy ``max|O - R| <= 1e-4 + 2 max|R - F|``, with ``|R - F|`` measured on that step: the
activation-quantisation error of this model on this input. The gate fails when onnxruntime's integers are not the
reference's (weights, scales, zero points, packing) or when its activations are quantised more coarsely than the
reference says (the reference without activation quantisation, ``R = F``, leaves only the 1e-4).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.kernels import registry as kernel_registry
from crosstrain.plugins.export.defaults import DEFAULT_TOLERANCE
from crosstrain.plugins.export.errors import ParityError
from crosstrain.plugins.export.parity import ParityReport, _Errors, _run_case, _step_sizes

#: Decode steps after each prefill (3 single tokens and a 3-token chunk).
DECODE_STEPS = 4


def parity_cases(max_seq_len: int) -> list[tuple[int, int]]:
    """The gate's 8 (batch, prompt length) pairs: one token, short and odd lengths, a wide batch and prompts of
    128 and 256 tokens (capped so the decode steps still fit in ``max_seq_len``)."""
    room = max(1, max_seq_len - DECODE_STEPS - 3)
    return [(2, min(8, room)), (1, 1), (4, min(16, room)), (1, min(256, room)), (3, min(31, room)),
            (2, min(128, room)), (1, min(57, room)), (8, min(4, room))]


class _FloatTwin:
    """``F`` of the module docstring, stepped alongside the reference with its own KV cache: each call runs it on
    the step's ids and returns the step's bound."""

    def __init__(self, twin: nn.Module) -> None:
        self.twin = twin
        self.past: Any = None

    def __call__(self, ids: torch.Tensor, logits: torch.Tensor) -> float:
        float_logits, self.past = self.twin.forward_with_cache(ids, self.past)  # type: ignore[operator]
        return DEFAULT_TOLERANCE + 2.0 * float((logits - float_logits).abs().max())


def check_integer_parity(reference: nn.Module, float_twin: nn.Module, onnx_path: str | os.PathLike[str], *,
                         tolerance: float | None = None, seed: int = 0, label: str = "int8",
                         raise_on_fail: bool = True) -> ParityReport:
    """Compare ``reference`` with the integer ONNX graph at ``onnx_path`` on :func:`parity_cases`; raise
    :class:`ParityError` when a step's error exceeds its bound (module docstring; ``float_twin`` is ``F``) or the
    fixed ``tolerance``."""
    from crosstrain.plugins.export.runtime import make_session

    cfg: Any = reference.config
    session = make_session(onnx_path)
    gen = torch.Generator().manual_seed(seed)
    errs = _Errors()
    cases = parity_cases(cfg.max_seq_len)
    with kernel_registry.use_reference(), torch.no_grad():
        for batch, length in cases:
            ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
            widths = _step_sizes(batch, length, DECODE_STEPS)
            bound = (lambda *_: tolerance) if tolerance is not None else _FloatTwin(float_twin)
            _run_case(reference, session, ids, widths, gen, bound, errs)  # type: ignore[arg-type]
    worst = max(errs.prefill, errs.decode)
    ok = bool(np.isfinite(worst)) and errs.ratio <= 1.0
    report = ParityReport(label, errs.bound, errs.worst, errs.prefill, errs.decode, errs.cache,
                          max(b for b, _ in cases), max(n for _, n in cases), DECODE_STEPS, ok, len(cases),
                          "fixed" if tolerance is not None else "derived")
    if not ok and raise_on_fail:
        raise ParityError(f"ONNX {label} parity check failed: {report.describe()}; nothing was written (pass a "
                          "fixed bound with --quant-tolerance only if this error is acceptable)")
    return report
