"""The CPU backend's native model-op kernels (backends/cpu/native/kernels.py, csrc/ops): dispatch, numerics on
shapes large enough for the threaded path, every instruction set this CPU has, edge cases, a GPT training
parity run, and the fallback when the extension is missing. The conformance suite checks the same kernels on
its small shared samples (crosstrain.testing.conformance)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from crosstrain.backends.cpu.native import kernels as native
from crosstrain.kernels import reference, registry
from crosstrain.testing.op_inputs import ROWS_AND_WIDTHS, SAMPLES, compare_with_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built: "
                                + native._IMPORT_ERROR)

OPS = tuple(native.OPS)


@pytest.fixture
def cpu_registry():
    previous = (registry.active_backend, registry.active_device_type, registry.mode)
    registry.set_active_backend("cpu", "cpu")
    registry.set_mode("auto")
    yield registry
    registry.set_active_backend(previous[0], previous[1])
    registry.set_mode(previous[2])


def test_registry_picks_native_by_default_and_reference_under_kernels_mode_reference(cpu_registry):
    from crosstrain.config.schema import Config

    for op in OPS:
        args, _ = SAMPLES[op](7, 97, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
        assert cpu_registry.resolve(op, *args) is native.OPS[op][0], op
        strided = args[0].transpose(0, -1).contiguous().transpose(0, -1)  # same shape, not contiguous
        assert cpu_registry.resolve(op, strided, *args[1:]) is reference.CORE_OPS[op][0], op
        assert cpu_registry.resolve(op, args[0].double(), *args[1:]) is reference.CORE_OPS[op][0], op
    labels = {i.label for op in OPS for i in cpu_registry.impls(op) if i.backend == "cpu"}
    assert labels == {f"native-{native.isa()}"}
    cfg = Config.model_validate({"kernels": {"mode": "reference"}})  # what the trainer hands to set_mode
    cpu_registry.set_mode(cfg.kernels.mode)
    for op in OPS:
        args, _ = SAMPLES[op](7, 97, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
        assert cpu_registry.resolve(op, *args) is reference.CORE_OPS[op][0], op


def _cases(dtype: torch.dtype) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """Inputs of 34K-51K elements (over the 32K of the threaded path), widths that are no multiple of a vector,
    ignored rows."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    angles = torch.randn(37, 33, generator=g)
    targets = torch.randint(0, 3001, (17,), generator=g)
    targets[::7] = -100
    lm_targets = torch.randint(0, 1999, (67,), generator=g)
    lm_targets[3] = -100
    return {
        "rms_norm": ((randn(3, 29, 515), (1 + 0.1 * torch.randn(515, generator=g)).to(dtype), 1e-5), (0, 1)),
        "rotary_embedding": ((randn(2, 37, 7, 66), angles.cos(), angles.sin()), (0,)),
        "swiglu": ((randn(37, 1031), randn(37, 1031)), (0, 1)),
        "cross_entropy": ((randn(17, 3001, scale=3.0), targets, -100), (0,)),
        "linear_cross_entropy": ((randn(67, 40, scale=0.5), randn(1999, 40, scale=0.3), lm_targets, -100), (0, 1)),
    }


def _run(fn, args: tuple, grad_idx: tuple[int, ...], upstream_seed: int = 1) -> list[torch.Tensor]:
    leaves = [a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    out = fn(*leaves)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed))
    (out.float() * up).sum().backward()
    return [out.detach().float(), *(leaves[i].grad.float() for i in grad_idx)]


def _assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max().clamp_min(1e-12)),
                                   msg=f"{what} {'forward' if i == 0 else f'gradient {i}'}")


def test_native_matches_reference_forward_and_backward(monkeypatch):
    """fp32 within 1e-5 relative and bf16 within 2e-2 on shapes that take the threaded path, with the instruction
    set picked at import; the portable (generic) build on the conformance samples (same source, other target)."""
    monkeypatch.setattr(native, "CHUNK_ELEMENTS", 40_000)  # 20 rows per linear_cross_entropy chunk: 4 chunks
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for op, (args, grad_idx) in _cases(dtype).items():
            _assert_matches(_run(native.OPS[op][0], args, grad_idx),
                            _run(reference.CORE_OPS[op][0], args, grad_idx), rtol, f"{native.isa()} {dtype} {op}")
    native._ext.set_isa("generic")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for op in OPS:
                for rows, width in (ROWS_AND_WIDTHS[1], ROWS_AND_WIDTHS[-1]):  # odd width, a 4099-wide row
                    compare_with_reference(native.OPS[op][0], reference.CORE_OPS[op][0], op, torch.device("cpu"),
                                           dtype, rows, width)
    finally:
        native._ext.set_isa("auto")


def test_cross_entropy_edge_cases_match_torch():
    logits = torch.randn(5, 11, requires_grad=True)
    ignored = torch.full((5,), -100)
    for fn in (native.cross_entropy, lambda lg, t: native.linear_cross_entropy(lg, torch.eye(11), t)):
        loss = fn(logits, ignored)  # every row ignored: torch gives nan and a zero gradient
        loss.backward()
        assert torch.isnan(loss) and torch.equal(logits.grad, torch.zeros_like(logits))
        logits.grad = None
    with pytest.raises(IndexError, match="target 11 is out of bounds for 11 classes"):
        native.cross_entropy(logits, torch.tensor([0, 1, 11, 2, 3]))
    bad = logits.detach().clone()
    bad[2, 4] = float("nan")
    assert torch.isnan(native.cross_entropy(bad, torch.arange(5))), "a NaN logit must make the loss NaN"
    # int32 targets, and an upstream gradient other than 1 (the fused op scales its stored gradients)
    h = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(13, 8, requires_grad=True)
    t = torch.randint(0, 13, (9,), dtype=torch.int32)
    (3.0 * native.linear_cross_entropy(h, w, t)).backward()
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    (3.0 * reference.linear_cross_entropy(h2, w2, t.long())).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: no gradient is computed or stored
        torch.testing.assert_close(native.linear_cross_entropy(h, w, t), reference.linear_cross_entropy(h, w, t.long()))


def test_swiglu_saturated_gates_match_the_reference():
    """Gates where sigmoid saturates (exp overflows to inf: sigmoid exactly 0 or 1) and tiny ones: finite values and
    gradients equal to torch's within 1e-6 absolute, on the picked and the portable instruction set."""
    edges = torch.tensor([0.0, 1e-30, -1e-30, 1e-4, 20.0, -20.0, 50.0, -50.0, 87.0, -87.0, 88.3, -88.3, 88.5, -88.5,
                          89.0, -89.0, 100.0, -100.0, 1e4, -1e4, 1e30, -1e30])
    gate = edges.repeat(48)  # 1056 elements: whole vectors and a tail
    up = torch.linspace(-2, 2, gate.numel())
    for isa in ("auto", "generic"):
        native._ext.set_isa(isa)
        try:
            got = _run(native.swiglu, (gate, up), (0, 1))
        finally:
            native._ext.set_isa("auto")
        want = _run(reference.swiglu, (gate, up), (0, 1))
        for a, b, what in zip(got, want, ("forward", "d gate", "d up"), strict=True):
            assert torch.isfinite(a).all(), f"{isa} {what}"
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{isa} swiglu {what}")


def test_gpt_training_with_native_kernels_tracks_reference_mode(cpu_registry):
    """Same seed, 3 AdamW steps of a tiny GPT (rms_norm, rotary, swiglu, cross_entropy all dispatched through the
    registry): native kernels vs kernels.mode=reference give losses within 1e-5 relative."""
    from crosstrain.models.gpt import GPT, GPTConfig
    from crosstrain.recipes.lm import next_token_loss

    def losses(mode: str) -> list[float]:
        cpu_registry.set_mode(mode)
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.randint(0, 256, (3, 2, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for batch in data:
            loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    fast, ref = losses("auto"), losses("reference")
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(ref), rtol=1e-5, atol=0)


def test_missing_extension_falls_back_to_the_references_with_one_warning():
    """Importing _kernels fails (as after a build without a compiler): the CPU backend registers no model-op
    kernel, says so once, and the ops still run (the references)."""
    code = """
import sys, torch
sys.modules["crosstrain.backends.cpu.native._kernels"] = None  # makes the import raise ImportError
from crosstrain.kernels import registry, reference, rms_norm
registry.set_active_backend("cpu", "cpu")
x = torch.randn(4, 8, requires_grad=True)
assert registry.resolve("rms_norm", x, torch.ones(8), 1e-6) is reference.rms_norm
rms_norm(x, torch.ones(8)).sum().backward()
assert registry.resolve("adamw_step", *[torch.zeros(3)] * 4, step=1, lr=0.1, beta1=0.9, beta2=0.9, eps=1e-8,
                        weight_decay=0.0) is not reference.CORE_OPS["adamw_step"][0], "the optimizer _C is unaffected"
print("fallback ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fallback ok" in out.stdout
    assert out.stderr.count("native CPU kernels not built") == 1, out.stderr
