"""crosstrain.models.fused_linear (additions inside the GEMMs) and the norm that sums its residual gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crosstrain import kernels
from crosstrain.models.fused_linear import fusable, project, residual_linear
from crosstrain.models.gpt import build_gpt


def _linears(bias: bool = False) -> tuple[nn.Linear, ...]:
    torch.manual_seed(0)
    return tuple(nn.Linear(48, n, bias=bias) for n in (48, 16, 16))


def _grads(x: torch.Tensor, linears: tuple[nn.Linear, ...], fused: bool) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    for m in linears:
        m.zero_grad(set_to_none=True)
    outs = project(x, linears) if fused else tuple(m(x) for m in linears)
    torch.manual_seed(1)
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    return [*outs, x.grad, *(m.weight.grad for m in linears)]


def test_matches_separate_linears() -> None:
    """Outputs and weight gradients are the plain calls' bit for bit (the same GEMMs); the input gradient sums the
    same products in another order (addmm accumulation), so it agrees to fp32 rounding."""
    linears = _linears()
    x = torch.randn(3, 7, 48)
    assert fusable(x, linears)
    fused, plain = _grads(x, linears, True), _grads(x, linears, False)
    for a, b in zip(fused[:3], plain[:3], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(fused[3], plain[3], rtol=1e-6, atol=1e-6)
    for a, b in zip(fused[4:], plain[4:], strict=True):
        assert torch.equal(a, b)


def test_frozen_input_or_weight() -> None:
    linears = _linears()
    linears[1].weight.requires_grad_(False)
    x = torch.randn(2, 5, 48, requires_grad=True)
    outs = project(x, linears)
    sum(o.sum() for o in outs).backward()
    assert linears[1].weight.grad is None and linears[0].weight.grad is not None
    expected = sum(m.weight.detach().sum(0) for m in linears)
    torch.testing.assert_close(x.grad, expected.expand_as(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bias", "hook", "autocast", "no_grad", "subclass"])
def test_falls_back_to_the_modules(case: str) -> None:
    """Whatever a plain module call would do differently runs the plain calls (and gives their result)."""
    linears = _linears(bias=case == "bias")
    x = torch.randn(2, 5, 48)
    seen: list[int] = []
    if case == "hook":
        linears[0].register_forward_hook(lambda m, i, o: seen.append(1))
    if case == "subclass":
        class Scaled(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2 * super().forward(x)

        scaled = Scaled(48, 16, bias=False)
        scaled.weight = linears[1].weight
        linears = (linears[0], scaled, linears[2])
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fusable(x, linears)
            assert project(x, linears)[0].dtype == torch.bfloat16
        return
    if case == "no_grad":
        with torch.no_grad():
            assert not fusable(x, linears)
        return
    assert not fusable(x, linears)
    for a, m in zip(project(x, linears), linears, strict=True):
        assert torch.equal(a, m(x))
    assert seen == ([1, 1] if case == "hook" else [])


def test_gpt_gradients_match_the_plain_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's loss and gradients agree to fp32 rounding with and without the fusions (the GEMMs add in another
    order)."""
    from crosstrain.models import fused_linear

    torch.manual_seed(0)
    model = build_gpt("tiny", vocab_size=64)
    tokens = torch.randint(0, 64, (2, 16))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused_loss, fused = run()
    monkeypatch.setattr(fused_linear, "fusable", lambda x, linears: False)
    monkeypatch.setattr(kernels, "rms_norm_residual", lambda x, w, eps: (x, kernels.rms_norm(x, w, eps)))
    plain_loss, plain = run()
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=0)
    assert fused.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_residual_linear_matches_the_add() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 32, bias=False)
    x, res = torch.randn(3, 7, 48), torch.randn(3, 7, 32)
    outs = []
    for fused in (True, False):
        xi, ri = x.clone().requires_grad_(), res.clone().requires_grad_()
        linear.zero_grad(set_to_none=True)
        out = residual_linear(ri, xi, linear) if fused else ri + linear(xi)
        out.backward(torch.ones_like(out) * torch.arange(32.0))
        outs.append((out.detach(), xi.grad, ri.grad, linear.weight.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not fusable(x, (nn.Linear(48, 32),))  # a bias: the plain add
    torch.testing.assert_close(residual_linear(res, x, linear), res + linear(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_residual_sums_both_gradients(dtype: torch.dtype) -> None:
    """``x``'s gradient through the norm plus the one through the residual, as autograd's add gives it (bit for bit:
    the kernel rounds dx before adding), whichever implementation the registry picks."""
    torch.manual_seed(0)
    x0, w = torch.randn(64, 96).to(dtype), torch.randn(96)
    dres, dy = torch.randn(64, 96).to(dtype), torch.randn(64, 96).to(dtype)
    from crosstrain.backends.cpu.native import kernels as native

    if native.available():  # the native kernel's fused backward is the one under test
        assert getattr(kernels.registry.resolve("rms_norm", x0, w, 1e-5), "with_residual", None) is not None
    grads = []
    for fused in (True, False):
        x = x0.clone().requires_grad_()
        res, y = kernels.rms_norm_residual(x, w, 1e-5) if fused else (x, kernels.rms_norm(x, w, 1e-5))
        torch.autograd.backward((res * 1, y), (dres, dy))
        grads.append((y.detach(), x.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    x = x0.clone().requires_grad_()  # only the residual used: its gradient alone
    res, _ = kernels.rms_norm_residual(x, w, 1e-5)
    res.backward(dres)
    assert torch.equal(x.grad, dres)
