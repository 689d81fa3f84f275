"""Kernel registry: declaration, dispatch by device and backend, reference mode, clear errors."""

from __future__ import annotations

import pytest
import torch

from crosstrain.errors import KernelError
from crosstrain.kernels import KernelRegistry, reference
from crosstrain.testing.op_inputs import compare_with_reference


@pytest.fixture
def reg(monkeypatch):
    monkeypatch.delenv("CROSSTRAIN_KERNELS", raising=False)
    r = KernelRegistry()
    r._populated = True  # isolated: no plugins, only what the test declares
    r.declare("rms_norm", reference.rms_norm, "rms")
    return r


def fast_rms(x, w, eps=1e-6):
    return reference.rms_norm(x, w, eps)


def test_dispatch_by_device_type_priority_and_predicate(reg):
    def low(x, w, eps=1e-6):
        return fast_rms(x, w, eps)

    reg.register("rms_norm", low, backend="cpu", device_type="cpu", priority=1, label="low")
    reg.register("rms_norm", fast_rms, backend="cpu", device_type="cpu", priority=10, label="fast",
                 supports=lambda x, w, eps=1e-6: x.shape[-1] % 8 == 0)
    x8, x7 = torch.randn(2, 8), torch.randn(2, 7)
    assert reg.resolve("rms_norm", x8, torch.ones(8)) is fast_rms
    assert reg.resolve("rms_norm", x7, torch.ones(7)) is low
    assert reg.resolve("rms_norm", torch.randn(2, 8, device="meta"), torch.ones(8)) is reference.rms_norm


def test_active_backend_owns_its_device_type(reg):
    def other(x, w, eps=1e-6):
        return fast_rms(x, w, eps)

    reg.register("rms_norm", other, backend="otherbox", device_type="cpu", priority=99)
    reg.register("rms_norm", fast_rms, backend="cpu", device_type="cpu", priority=1)
    x = torch.randn(2, 8)
    reg.set_active_backend("cpu", "cpu")
    assert reg.resolve("rms_norm", x, torch.ones(8)) is fast_rms
    reg.set_active_backend("accel", "accel")  # host tensors of an accelerator job use the host kernels
    assert reg.resolve("rms_norm", x, torch.ones(8)) is other


def test_reference_mode_from_env_and_context(reg, monkeypatch):
    reg.register("rms_norm", fast_rms, backend="cpu", device_type="cpu")
    x = torch.randn(2, 8)
    with reg.use_reference():
        assert reg.resolve("rms_norm", x, torch.ones(8)) is reference.rms_norm
    assert reg.resolve("rms_norm", x, torch.ones(8)) is fast_rms
    monkeypatch.setenv("CROSSTRAIN_KERNELS", "reference")
    forced = KernelRegistry()
    forced._populated = True
    forced.declare("rms_norm", reference.rms_norm)
    forced.register("rms_norm", fast_rms, backend="cpu", device_type="cpu")
    assert forced.resolve("rms_norm", x, torch.ones(8)) is reference.rms_norm
    monkeypatch.setenv("CROSSTRAIN_KERNELS", "turbo")
    with pytest.raises(KernelError, match="CROSSTRAIN_KERNELS='turbo' is not allowed"):
        KernelRegistry()


def test_unknown_op_and_redeclaration_errors(reg):
    with pytest.raises(KernelError, match="unknown kernel op 'nope'; declared ops: rms_norm"):
        reg.call("nope", torch.ones(1))
    with pytest.raises(KernelError, match="unknown kernel op"):
        reg.register("nope", fast_rms, backend="cpu", device_type="cpu")
    with pytest.raises(KernelError, match="already declared"):
        reg.declare("rms_norm", reference.swiglu)


def test_compare_with_reference_detects_a_wrong_kernel():
    def wrong(x, w, eps=1e-6):
        return reference.rms_norm(x, w, eps) * 1.01

    compare_with_reference(fast_rms, reference.rms_norm, "rms_norm", torch.device("cpu"), torch.float32, 7, 97)
    with pytest.raises(AssertionError, match="rms_norm forward"):
        compare_with_reference(wrong, reference.rms_norm, "rms_norm", torch.device("cpu"), torch.float32, 7, 97)


def test_moe_reference_ops_round_trip():
    tokens = torch.randn(5, 4)
    expert_ids = torch.tensor([[1, 0], [2, 1], [0, 0], [2, 2], [1, 2]])
    permuted, order, counts = reference.moe_permute(tokens, expert_ids, 3)
    assert counts.tolist() == [3, 3, 4]
    weights = torch.full((5, 2), 0.5)
    combined = reference.moe_unpermute(permuted, order, weights)
    torch.testing.assert_close(combined, tokens)
    w = torch.randn(3, 4, 6)
    out = reference.grouped_mm(permuted, w, counts)
    expected_first = permuted[:3] @ w[0]
    torch.testing.assert_close(out[:3], expected_first)
