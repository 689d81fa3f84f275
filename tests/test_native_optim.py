"""The native fused CPU optimizer kernels: parity with torch.optim and the references, dtypes, edge cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from crosstrain.backends.cpu import native
from crosstrain.backends.cpu.native.optim import FusedAdamW, FusedSGD
from crosstrain.errors import KernelError
from crosstrain.kernels import registry
from crosstrain.optim import reference

ISAS = [isa for isa in ("avx512", "avx2", "generic") if native.load().cpu_supports(isa)]
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {"fp32": torch.float32, **LOW}


@pytest.fixture
def isa(request):
    native.set_isa(request.param)
    yield request.param
    native.set_isa("auto")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Relative to the tensor's scale: norm-wise and element-wise (atol = tol * max|b|)."""
    assert _rel(a, b) <= tol
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item() + 1e-30)


def test_extension_is_built_and_dispatches():
    assert native.available()
    assert native.isa() in ("avx512", "avx2", "generic")
    t = torch.zeros(4)
    impl = registry.resolve("adamw_step", t, t, t, t, None, None, step=1, lr=1.0, beta1=0.9, beta2=0.99, eps=1e-8,
                            weight_decay=0.0)
    assert impl is native.adamw_step
    assert registry.resolve("sgd_step", t, t, None, None, lr=0.1) is native.sgd_step
    with registry.use_reference():
        assert registry.resolve("adamw_step", t, t, t, t, None, None, step=1, lr=1.0, beta1=0.9, beta2=0.99,
                                eps=1e-8, weight_decay=0.0) is reference.adamw_step
    # non-contiguous tensors go to the reference, which handles them
    nc = torch.zeros(4, 4).t()
    assert registry.resolve("sgd_step", nc, nc, None, None, lr=0.1) is reference.sgd_step


@pytest.mark.parametrize("n,amsgrad", [(1, False), (7, False), (2**20 + 3, False), (7, True), (4099, True)])
def test_adamw_matches_torch_over_100_steps(n, amsgrad):
    g = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g)
    pool = [torch.randn(n, generator=g) * 0.1 for _ in range(3)]  # cheap, varied gradients
    ours = torch.nn.Parameter(p0.clone())
    theirs = torch.nn.Parameter(p0.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    # torch's fused CPU AdamW for the large size (the single-tensor loop is slow on a busy 2-core machine)
    opt_a, opt_b = FusedAdamW([ours], **kw), torch.optim.AdamW([theirs], fused=n > 10**6, **kw)
    for step in range(100):
        grad = pool[step % 3] * (1.0 + 0.01 * step)
        ours.grad, theirs.grad = grad, grad.clone()
        opt_a.step()
        opt_b.step()
    _assert_rel(ours.detach(), theirs.detach(), 1e-6)
    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
        _assert_rel(opt_a.state[ours][key], opt_b.state[theirs][key], 1e-6)
    assert opt_a.state[ours]["step"].item() == 100


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("grad_name", ["fp32", "bf16", "fp16"])
def test_adamw_every_dtype_combination(isa, grad_name):
    sizes = (5, 1037, 70001) if isa == ISAS[0] else (5, 1037)  # tails, vector body, multi-threaded split
    for out_name in ("none", "fp32", "bf16", "fp16"):
        for amsgrad in (False, True):
            for n in sizes:
                _check_adamw_once(n, grad_name, out_name, amsgrad)


def _check_adamw_once(n: int, grad_name: str, out_name: str, amsgrad: bool) -> None:
    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 0.3).to(DTYPES[grad_name])
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    vmax = v + torch.rand(n, generator=g) * 0.01 if amsgrad else None
    out = None if out_name == "none" else torch.empty(n, dtype=DTYPES[out_name])
    ref = [t.clone() for t in (p, m, v)] + [vmax.clone() if amsgrad else None]
    kw = dict(step=5, lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, grad_scale=0.5)
    native.adamw_step(p, grad, m, v, vmax, out, **kw)
    reference.adamw_step(ref[0], grad.float(), ref[1], ref[2], ref[3], None, **kw)
    _assert_rel(p, ref[0], 1e-6)
    _assert_rel(m, ref[1], 1e-6)
    _assert_rel(v, ref[2], 1e-6)
    if amsgrad:
        _assert_rel(vmax, ref[3], 1e-6)
    if out is not None:  # the low-precision copy is the new master rounded to nearest even
        assert torch.equal(out, p.to(out.dtype))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("grad_name", ["fp32", "bf16", "fp16"])
def test_sgd_every_dtype_and_option(isa, grad_name):
    for n in (5, 1037, 70001) if isa == ISAS[0] else (5, 1037):
        _check_sgd_options(n, grad_name)


def _check_sgd_options(n: int, grad_name: str) -> None:
    for momentum, dampening, nesterov, wd, maximize in [(0.0, 0.0, False, 0.0, False), (0.9, 0.0, False, 0.01, False),
                                                        (0.9, 0.0, True, 0.01, True), (0.8, 0.3, False, 0.0, False)]:
        for out_name in ("none", "bf16", "fp16", "fp32"):
            g = torch.Generator().manual_seed(7)
            p, buf = torch.randn(n, generator=g), torch.randn(n, generator=g)
            grad = torch.randn(n, generator=g).to(DTYPES[grad_name])
            out = None if out_name == "none" else torch.empty(n, dtype=DTYPES[out_name])
            rp, rbuf = p.clone(), buf.clone()
            kw = dict(lr=0.05, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov,
                      maximize=maximize)
            for first in (True, False):
                native.sgd_step(p, grad, buf, out, first_step=first, **kw)
                reference.sgd_step(rp, grad.float(), rbuf, None, first_step=first, **kw)
            _assert_rel(p, rp, 1e-6)
            if momentum:
                _assert_rel(buf, rbuf, 1e-6)
            if out is not None:
                assert torch.equal(out, p.to(out.dtype))


@pytest.mark.parametrize("nesterov,dampening,wd,maximize", [(False, 0.0, 0.0, False), (True, 0.0, 1e-2, False),
                                                             (False, 0.5, 1e-2, True)])
@pytest.mark.parametrize("n", [7, 65537])
def test_sgd_matches_torch_over_100_steps(n, nesterov, dampening, wd, maximize):
    g = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g)
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kw = dict(lr=1e-2, momentum=0.9, dampening=dampening, weight_decay=wd, nesterov=nesterov, maximize=maximize)
    opt_a, opt_b = FusedSGD([ours], **kw), torch.optim.SGD([theirs], **kw)
    for _ in range(100):
        grad = torch.randn(n, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    _assert_rel(ours.detach(), theirs.detach(), 1e-6)
    _assert_rel(opt_a.state[ours]["momentum_buffer"], opt_b.state[theirs]["momentum_buffer"], 1e-6)


def test_bf16_model_with_fp32_master_tracks_fp32_training():
    """bf16 params + bf16 grads through FusedAdamW stay within bf16 tolerance of fp32 AdamW on fp32 grads."""
    g = torch.Generator().manual_seed(0)
    n = 4099
    p0 = torch.randn(n, generator=g)
    low = torch.nn.Parameter(p0.to(torch.bfloat16))
    ref = torch.nn.Parameter(low.detach().float())
    opt_low = FusedAdamW([low], lr=1e-3, weight_decay=0.01)
    opt_ref = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    for _ in range(100):
        grad = torch.randn(n, generator=g)
        low.grad, ref.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        opt_low.step()
        opt_ref.step()
    master = opt_low.state[low]["master"]
    _assert_rel(master, ref.detach(), 1e-6)  # the bf16 grad is exact in fp32: the fp32 master matches
    assert torch.equal(low.detach(), master.to(torch.bfloat16))
    torch.testing.assert_close(low.detach().float(), ref.detach(), rtol=2**-8, atol=1e-5)
    # a pure-bf16 update (no master) would have lost most of these small steps
    assert (low.detach().float() - p0.to(torch.bfloat16).float()).abs().max() > 0


def test_state_dict_round_trip_keeps_fp32_master():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    clone = torch.nn.Linear(16, 8).to(torch.bfloat16)
    clone.load_state_dict(model.state_dict())
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16).to(torch.bfloat16)
    for _ in range(3):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    clone.load_state_dict(model.state_dict())
    opt2 = FusedAdamW(clone.parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for p in clone.parameters():
        assert opt2.state[p]["master"].dtype == torch.float32 and opt2.state[p]["exp_avg"].dtype == torch.float32
    for m, o in ((model, opt), (clone, opt2)):
        m(x).float().pow(2).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["master"], opt2.state[b]["master"])


def test_empty_noncontiguous_and_bad_dtypes():
    e = torch.empty(0)
    native.adamw_step(e, e, e, e, None, torch.empty(0, dtype=torch.bfloat16), step=1, lr=1e-3, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=0.0)
    native.sgd_step(e, e, e, None, lr=0.1, momentum=0.9)
    opt = FusedAdamW([torch.nn.Parameter(torch.empty(0))])
    opt.param_groups[0]["params"][0].grad = torch.empty(0)
    opt.step()

    t = torch.zeros(8, 8)
    with pytest.raises(KernelError, match="grad is not contiguous"):
        native.adamw_step(t, t.t(), t, t, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(KernelError, match="grad has dtype float64"):
        native.adamw_step(t, t.double(), t, t, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(KernelError, match="exp_avg has dtype bfloat16"):
        native.adamw_step(t, t, t.bfloat16(), t, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0)
    with pytest.raises(KernelError, match="has 4 elements"):
        native.sgd_step(t, torch.zeros(4), lr=0.1)
    with pytest.raises(KernelError, match="takes fp32/bf16/fp16 parameters, got float64"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(KernelError, match="instruction set"):
        native.set_isa("sse9")

    # non-contiguous parameters still train correctly (through the reference)
    base = torch.randn(6, 5)
    ours, theirs = torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(base.clone().t())
    assert not ours.is_contiguous()
    opt_a, opt_b = FusedAdamW([ours], lr=0.1), torch.optim.AdamW([theirs], lr=0.1)
    for _ in range(3):
        grad = torch.randn(5, 6)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


def test_missing_extension_is_a_clear_error_and_falls_back():
    code = (
        "import sys; sys.modules['crosstrain.backends.cpu.native._C'] = None\n"
        "import torch\n"
        "from crosstrain.backends.cpu import native\n"
        "from crosstrain.backends.cpu.native.optim import FusedAdamW\n"
        "assert not native.available()\n"
        "try:\n"
        "    native.load()\n"
        "except native.NativeExtensionMissing as exc:\n"
        "    print('ERR', exc)\n"
        "p = torch.nn.Parameter(torch.ones(3)); opt = FusedAdamW([p], lr=0.1); p.grad = torch.ones(3); opt.step()\n"
        "print('STEP', p.detach().tolist())\n"
    )
    env = dict(os.environ, CROSSTRAIN_BACKEND="cpu")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "ERR the native CPU optimizer extension is not built" in res.stdout
    assert "reinstall" in res.stdout
    values = eval(res.stdout.split("STEP", 1)[1].strip())
    assert all(abs(v - (1 - 0.1 * 0.01) + 0.1) < 1e-5 for v in values)  # one Adam step: ~ -lr


@pytest.mark.parametrize("cls,kw", [(FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
                                    (FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))])
def test_step_grad_scale_is_clipping_the_gradients_first(cls, kw):
    """The training loop hands the fused optimizers the clipping factor (``step(grad_scale=...)``) instead of scaling
    every gradient in place: the same update bit for bit, the gradients left as they are."""
    from crosstrain.parallel.grad import clip_coefficient, clip_grad_norm_

    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=g)
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt_a, opt_b = cls([ours], **kw), cls([theirs], **kw)
    assert opt_a.takes_grad_scale
    for _ in range(3):
        grad = torch.randn(1000, generator=g) * 5
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        norm = clip_grad_norm_([theirs], 1.0)  # scales theirs.grad in place
        coef = float(clip_coefficient(norm, 1.0))
        assert coef < 1.0
        opt_a.step(grad_scale=coef)
        opt_b.step()
        assert torch.equal(ours.grad, grad)
    assert torch.equal(ours.detach(), theirs.detach())
