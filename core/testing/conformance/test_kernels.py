"""Kernel registry conformance: every kernel the backend registers matches its reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from crosstrain.kernels import registry
from crosstrain.testing.op_inputs import ROWS_AND_WIDTHS, SAMPLES, compare_with_reference


def _backend_impls(backend, device_type: str) -> list:
    return [impl for op in registry.ops() for impl in registry.impls(op)
            if impl.backend == backend.name and impl.device_type == device_type and op in SAMPLES]


def test_every_core_op_has_a_reference():
    ops = registry.ops()
    for op in ("rms_norm", "rotary_embedding", "swiglu", "cross_entropy"):
        assert op in ops and callable(ops[op].reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_registered_kernels_match_reference(backend, device, dtype):
    if dtype not in device.supported_dtypes():
        pytest.skip(f"{dtype} unsupported on {backend.name}")
    impls = _backend_impls(backend, device.type)
    if not impls:
        pytest.skip(f"backend {backend.name!r} registers no kernels of its own; dispatch uses the references")
    dev = device.current_device()
    checked = 0
    for impl in impls:
        for rows, width in ROWS_AND_WIDTHS:
            g = torch.Generator().manual_seed(0)
            args, _ = SAMPLES[impl.op](rows, width, dev, dtype, g)
            if not impl.accepts(args, {}):
                continue
            compare_with_reference(impl.fn, registry.reference(impl.op), impl.op, dev, dtype, rows, width)
            checked += 1
    assert checked > 0, "no registered kernel accepted any sample input"


def test_dispatch_prefers_backend_kernel_and_honours_reference_mode(backend, device):
    dev = device.current_device()
    x = torch.randn(4, 64, device=dev)
    w = torch.ones(64, device=dev)
    chosen = registry.resolve("rms_norm", x, w, 1e-5)
    own = [i for i in registry.impls("rms_norm") if i.backend == backend.name and i.device_type == device.type
           and i.accepts((x, w, 1e-5), {})]
    assert chosen is (own[0].fn if own else registry.reference("rms_norm"))
    with registry.use_reference():
        assert registry.resolve("rms_norm", x, w, 1e-5) is registry.reference("rms_norm")


def test_unknown_op_is_a_clear_error():
    from crosstrain.errors import KernelError

    with pytest.raises(KernelError, match="unknown kernel op 'no_such_op'"):
        registry.call("no_such_op", torch.ones(1))


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_reference_matches_plain_torch(device, op):
    """The references themselves agree with independent torch formulas (guards the semantics)."""
    dev = device.current_device()
    g = torch.Generator().manual_seed(3)
    args, _ = SAMPLES[op](7, 97, dev, torch.float32, g)
    ref = registry.reference(op)(*args)
    F = torch.nn.functional
    if op == "rms_norm":
        x, w, eps = args
        expected = F.rms_norm(x, (x.shape[-1],), w, eps)
    elif op == "swiglu":
        expected = F.silu(args[0]) * args[1]
    elif op == "cross_entropy":
        expected = F.cross_entropy(args[0], args[1], ignore_index=-100)
    elif op == "linear_cross_entropy":
        expected = F.cross_entropy(args[0] @ args[1].t(), args[2], ignore_index=-100)
    elif op in ("moe_permute", "moe_unpermute", "grouped_mm"):
        expected = _moe_by_loops(op, args)
    else:  # rotary: rotating by angle then by -angle is the identity
        x, cos, sin = args
        expected = x
        ref = registry.reference(op)(ref, cos, -sin)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)


def _moe_by_loops(op: str, args: tuple) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The MoE ops written as plain per-expert / per-token Python loops."""
    if op == "moe_permute":
        tokens, expert_ids, num_experts = args
        n, k = expert_ids.shape
        slots = [(e, t * k + j) for e in range(num_experts) for t in range(n) for j in range(k)
                 if int(expert_ids[t, j]) == e]
        order = torch.tensor([slot for _, slot in slots], device=tokens.device)
        counts = torch.tensor([sum(1 for e2, _ in slots if e2 == e) for e in range(num_experts)], device=tokens.device)
        return tokens[order // k], order, counts
    if op == "moe_unpermute":
        permuted, order, weights = args
        n, k = weights.shape
        row_of_slot = {int(slot): i for i, slot in enumerate(order)}
        return torch.stack([sum(weights[t, j] * permuted[row_of_slot[t * k + j]] for j in range(k)) for t in range(n)])
    x, weights, counts = args
    outs, start = [], 0
    for g, count in enumerate(int(c) for c in counts):
        outs.append(x[start:start + count] @ weights[g])
        start += count
    return torch.cat(outs)
