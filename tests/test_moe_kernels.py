"""The MoE kernel ops: public wrappers, conformance samples (an expert with zero tokens), and grouped_mm against
the per-expert loop, forward and backward, with at most one host sync however many experts."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from crosstrain import kernels
from crosstrain.kernels import reference, registry
from crosstrain.testing.op_inputs import MOE_UNUSED, ROWS_AND_WIDTHS, SAMPLES, compare_with_reference

CPU = torch.device("cpu")
MOE_OPS = ("moe_permute", "moe_unpermute", "grouped_mm")
#: tensor methods that wait for the device to read a value on the host
HOST_SYNCS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy"}


class _CountHostSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_SYNCS
        return func(*args, **(kwargs or {}))


def _loop_grouped_mm(x: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The straightforward per-expert loop (what grouped_mm means)."""
    outs, start = [], 0
    for g, count in enumerate(counts):
        outs.append(x[start:start + count] @ weights[g])
        start += count
    return torch.cat(outs)


def test_public_wrappers_dispatch_to_the_references():
    tokens = torch.randn(5, 4)
    ids = torch.tensor([[1, 0], [3, 1], [0, 3], [3, 0], [1, 3]])  # expert 2 gets no tokens
    permuted, order, counts = kernels.moe_permute(tokens, ids, 4)
    assert counts.tolist() == [3, 3, 0, 4]
    torch.testing.assert_close(permuted, reference.moe_permute(tokens, ids, 4)[0])
    combined = kernels.moe_unpermute(permuted, order, torch.full((5, 2), 0.5))
    torch.testing.assert_close(combined, tokens)
    w = torch.randn(4, 4, 6)
    torch.testing.assert_close(kernels.grouped_mm(permuted, w, counts), _loop_grouped_mm(permuted, w, [3, 3, 0, 4]))
    assert all(op in registry.ops() for op in MOE_OPS)


@pytest.mark.parametrize("op", MOE_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_samples_run_through_compare_with_reference(op, dtype):
    for rows, width in ROWS_AND_WIDTHS:
        compare_with_reference(reference.CORE_OPS[op][0], reference.CORE_OPS[op][0], op, CPU, dtype, rows, width)
    args, _ = SAMPLES[op](7, 97, CPU, torch.float32, torch.Generator().manual_seed(0))
    if op == "grouped_mm":
        assert args[2][MOE_UNUSED] == 0 and args[2].sum() == args[0].shape[0]
    if op == "moe_permute":
        assert not (args[1] == MOE_UNUSED).any()


def test_compare_with_reference_catches_wrong_moe_kernels():
    def wrong_counts(tokens, ids, num_experts):
        permuted, order, counts = reference.moe_permute(tokens, ids, num_experts)
        return permuted, order, counts.roll(1)

    def wrong_grad(x, weights, counts):  # right forward, no gradient into the weights
        return reference.grouped_mm(x, weights.detach(), counts) + 0 * weights.sum()

    with pytest.raises(AssertionError, match=r"moe_permute forward \(output 2\)"):
        compare_with_reference(wrong_counts, reference.moe_permute, "moe_permute", CPU, torch.float32, 7, 97)
    with pytest.raises(AssertionError, match="grouped_mm gradient of input 1"):
        compare_with_reference(wrong_grad, reference.grouped_mm, "grouped_mm", CPU, torch.float32, 7, 97)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 4, 0, 0], [0, 0, 0, 0], [9]])
def test_grouped_mm_matches_per_expert_loop_with_gradients(counts):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(sum(counts), 5, generator=g, dtype=torch.float64)
    out = reference.grouped_mm(x, w, torch.tensor(counts))
    (out * up).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = _loop_grouped_mm(x2, w2, counts)
    (want * up).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(w.grad[e]) == 0  # an expert with no tokens gets a zero gradient


def test_grouped_mm_has_one_host_sync_for_any_number_of_experts():
    for experts in (2, 64):
        counts = torch.randint(0, 4, (experts,), generator=torch.Generator().manual_seed(experts))
        x = torch.randn(int(counts.sum()), 8, requires_grad=True)
        w = torch.randn(experts, 8, 3, requires_grad=True)
        with _CountHostSyncs() as mode:
            out = reference.grouped_mm(x, w, counts)
            out.sum().backward()
        assert mode.count <= 1, f"{mode.count} host syncs for {experts} experts"
        with _CountHostSyncs() as naive:  # the counter does see a sync per expert
            _loop_grouped_mm(x, w, [int(c) for c in counts])
        assert naive.count == experts
