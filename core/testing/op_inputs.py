"""Sample inputs and dtype-aware tolerances for checking kernel implementations against their references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: (atol, rtol) per dtype for forward outputs and input gradients.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}

#: shapes checked per op: odd widths, a single row, and a long row.
ROWS_AND_WIDTHS = ((1, 8), (7, 97), (33, 256), (2, 4099))


def _rms_norm(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    x = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(device=device, dtype=dtype)
    return (x, w, 1e-5), (0, 1)


def _rotary(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    head_dim = max(2, (width // 2) * 2 if width < 256 else 128)
    seq = max(1, rows)
    x = torch.randn(2, seq, 3, head_dim, generator=g).to(device=device, dtype=dtype)
    angles = torch.randn(seq, head_dim // 2, generator=g)
    return (x, angles.cos().to(device), angles.sin().to(device)), (0,)


def _swiglu(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    gate = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    up = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    return (gate, up), (0, 1)


def _cross_entropy(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    logits = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    targets = torch.randint(0, width, (rows,), generator=g)
    if rows > 2:
        targets[1] = -100
    return (logits, targets.to(device), -100), (0,)


def _linear_ce(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    hidden = (torch.randn(rows, 32, generator=g) * 0.5).to(device=device, dtype=dtype)
    weight = (torch.randn(width, 32, generator=g) * 0.2).to(device=device, dtype=dtype)
    targets = torch.randint(0, width, (rows,), generator=g).to(device)
    return (hidden, weight, targets, -100), (0, 1)


#: MoE samples: 4 experts, top-2 routing, expert 2 never chosen (an expert with zero tokens).
MOE_EXPERTS, MOE_TOP_K, MOE_UNUSED = 4, 2, 2


def _expert_ids(rows: int, g: torch.Generator) -> torch.Tensor:
    """``[rows, top_k]`` distinct experts per token, never :data:`MOE_UNUSED`."""
    used = torch.tensor([e for e in range(MOE_EXPERTS) if e != MOE_UNUSED])
    picks = torch.stack([torch.randperm(len(used), generator=g)[:MOE_TOP_K] for _ in range(rows)])
    return used[picks]


def _moe_permute(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    tokens = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    return (tokens, _expert_ids(rows, g).to(device), MOE_EXPERTS), (0,)


def _moe_unpermute(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    permuted = torch.randn(rows * MOE_TOP_K, width, generator=g).to(device=device, dtype=dtype)
    order = torch.randperm(rows * MOE_TOP_K, generator=g).to(device)
    weights = torch.randn(rows, MOE_TOP_K, generator=g).softmax(-1).to(device=device, dtype=dtype)
    return (permuted, order, weights), (0, 2)


def _grouped_mm(rows: int, width: int, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple:
    n, out_width = rows * MOE_TOP_K, 16
    x = torch.randn(n, width, generator=g).to(device=device, dtype=dtype)
    weights = (torch.randn(MOE_EXPERTS, width, out_width, generator=g) / width**0.5).to(device=device, dtype=dtype)
    counts = torch.bincount(_expert_ids(rows, g).reshape(-1), minlength=MOE_EXPERTS)  # counts[MOE_UNUSED] == 0
    return (x, weights, counts.to(device)), (0, 1)


#: op name -> builder(rows, width, device, dtype, generator) -> (args, indices of args that need gradients)
SAMPLES: dict[str, Callable[..., tuple[tuple[Any, ...], tuple[int, ...]]]] = {
    "rms_norm": _rms_norm,
    "rotary_embedding": _rotary,
    "swiglu": _swiglu,
    "cross_entropy": _cross_entropy,
    "linear_cross_entropy": _linear_ce,
    "moe_permute": _moe_permute,
    "moe_unpermute": _moe_unpermute,
    "grouped_mm": _grouped_mm,
}


def compare_with_reference(impl: Callable[..., Any], reference: Callable[..., Any], op: str, device: torch.device,
                           dtype: torch.dtype, rows: int, width: int, seed: int = 0) -> None:
    """Assert that ``impl`` matches ``reference`` in forward output and input gradients (raises AssertionError).

    Ops with several outputs (``moe_permute``) are compared output by output: floating-point outputs within the
    dtype's tolerance (and each gets an upstream gradient), integer outputs exactly.
    """
    g = torch.Generator().manual_seed(seed)
    args, grad_idx = SAMPLES[op](rows, width, device, dtype, g)

    def run(fn: Callable[..., Any]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        leaves = [a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(args)]
        result = fn(*leaves)
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        terms = [(out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1 + i))
                  .to(out.device)).sum() for i, out in enumerate(outs) if out.is_floating_point()]
        if terms:
            torch.stack(terms).sum().backward()
        return [out.detach() for out in outs], [leaves[i].grad for i in grad_idx]

    outs_impl, grads_impl = run(impl)
    outs_ref, grads_ref = run(reference)
    atol, rtol = TOLERANCES[dtype]
    assert len(outs_impl) == len(outs_ref), f"{op} forward: {len(outs_impl)} outputs, the reference has {len(outs_ref)}"
    for i, (oi, orf) in enumerate(zip(outs_impl, outs_ref, strict=True)):
        what = f"{op} forward" + (f" (output {i})" if len(outs_ref) > 1 else "")
        if orf.is_floating_point():
            torch.testing.assert_close(oi.float(), orf.float(), atol=atol, rtol=rtol, msg=what)
        else:
            assert torch.equal(oi.cpu(), orf.cpu()), what
    for i, (gi, gr) in enumerate(zip(grads_impl, grads_ref, strict=True)):
        assert gi is not None and gr is not None, f"{op}: no gradient for input {grad_idx[i]}"
        torch.testing.assert_close(gi.float(), gr.float(), atol=atol, rtol=rtol,
                                   msg=f"{op} gradient of input {grad_idx[i]}")
