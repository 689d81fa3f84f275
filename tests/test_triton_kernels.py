"""The shared Triton kernels (cuda/rocm) run on the CPU under ``TRITON_INTERPRET=1`` against the reference ops.

These check the kernels' arithmetic, masking, chunking and autograd wiring, forward and backward, in fp32 and
bf16 on odd shapes. They are not hardware tests: launch configs, autotuning and speed are only exercised on a
GPU (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# triton decides interpreted-or-compiled when a function is decorated, including its own standard library at
# import. So the flag must be set before triton is first imported; if something imported it earlier in this
# process, the whole module is re-run in a fresh process instead (test_fresh_process).
_PRELOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
if not _PRELOADED:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from crosstrain.backends.triton.register import TRITON_OPS  # noqa: E402
from crosstrain.kernels import KernelRegistry, reference  # noqa: E402
from crosstrain.testing.op_inputs import ROWS_AND_WIDTHS, SAMPLES, TOLERANCES, compare_with_reference  # noqa: E402

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def interpret():
    if _PRELOADED:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in list(sys.modules):
        if name.startswith("crosstrain.backends.triton.") and name.split(".")[-1] not in ("register", "launch"):
            del sys.modules[name]  # kernels imported earlier without the flag are re-imported under it
    yield
    if _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


@pytest.fixture(autouse=True)
def _in_process_only(request):
    if _PRELOADED and request.node.name != "test_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET=1; covered by test_fresh_process")


def test_fresh_process():
    if not _PRELOADED:
        pytest.skip("ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def triton_op(op: str):
    from crosstrain.backends.triton.register import TRITON_OPS, _module

    module, fn, _ = TRITON_OPS[op]
    _module.cache_clear()
    return getattr(_module(module), fn)


@pytest.mark.parametrize("rows,width", ROWS_AND_WIDTHS, ids=[f"{r}x{w}" for r, w in ROWS_AND_WIDTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", sorted(op for op in SAMPLES if op in TRITON_OPS))
def test_kernel_matches_reference_forward_and_backward(op, dtype, rows, width):
    compare_with_reference(triton_op(op), reference.CORE_OPS[op][0], op, CPU, dtype, rows, width)


def _grads(fn, args, grad_idx, seed=5):
    leaves = [a.detach().clone().requires_grad_(i in grad_idx) if isinstance(a, torch.Tensor) else a
              for i, a in enumerate(args)]
    out = fn(*leaves)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.float() * up).sum().backward()
    return out.detach().float(), [leaves[i].grad.float() for i in grad_idx]


def _lce_inputs(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [rows, 16], an lm-head weight [vocab, 16] and targets for linear_cross_entropy."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 16, generator=g)
    w = torch.randn(vocab, 16, generator=g) * 0.3
    return h, w, torch.randint(0, vocab, (rows,), generator=g)


def _assert_same(fn, ref, args, grad_idx, dtype=torch.float32):
    atol, rtol = TOLERANCES[dtype]
    out, grads = _grads(fn, args, grad_idx)
    out_r, grads_r = _grads(ref, args, grad_idx)
    torch.testing.assert_close(out, out_r, atol=atol, rtol=rtol, equal_nan=True)
    for g, gr in zip(grads, grads_r, strict=True):
        torch.testing.assert_close(g, gr, atol=atol, rtol=rtol, equal_nan=True)


def test_rms_norm_3d_input_and_many_rows_per_program():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, 40, generator=g)  # 33 rows over 4 programs: the last program has rows past the end
    w = torch.randn(40, generator=g)
    _assert_same(triton_op("rms_norm"), reference.rms_norm, (x, w, 1e-5), (0, 1))


def test_rotary_without_batch_dim_and_with_many_heads():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 9, 10, generator=g)  # [T, H, D], odd head count, D/2 = 5
    ang = torch.randn(5, 5, generator=g)
    _assert_same(triton_op("rotary_embedding"), reference.rotary_embedding, (x, ang.cos(), ang.sin()), (0,))


def test_cross_entropy_ignored_rows_and_all_ignored_is_nan_like_torch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 37, generator=g)
    targets = torch.tensor([0, -100, 36, 5, -100, 17])
    _assert_same(triton_op("cross_entropy"), reference.cross_entropy, (logits, targets, -100), (0,))
    targets = torch.tensor([3, 3, 1, 1, 7, 7])
    _assert_same(triton_op("cross_entropy"), reference.cross_entropy, (logits, targets, 3), (0,))
    all_ignored = torch.full((6,), -100)
    assert torch.isnan(triton_op("cross_entropy")(logits, all_ignored))
    assert torch.isnan(reference.cross_entropy(logits, all_ignored))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_linear_cross_entropy_chunks_agree(chunk):
    from crosstrain.backends.triton import cross_entropy as ce

    g = torch.Generator().manual_seed(4)
    h = torch.randn(10, 24, generator=g) * 0.5
    w = torch.randn(131, 24, generator=g) * 0.2
    t = torch.randint(0, 131, (10,), generator=g)
    t[4] = -100
    loss, gh, gw = ce._lce_forward(h, w, t, -100, need_grad=True, chunk=chunk)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference.linear_cross_entropy(hr, wr, t)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, wr.grad, atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_scales_by_upstream_grad_and_skips_grad_without_autograd():
    h, w, t = _lce_inputs(6, 7, 50)
    fn = triton_op("linear_cross_entropy")
    _assert_same(lambda a, b: fn(a, b, t) * 3.5, lambda a, b: reference.linear_cross_entropy(a, b, t) * 3.5,
                 (h, w), (0, 1))
    with torch.no_grad():
        torch.testing.assert_close(fn(h, w, t), reference.linear_cross_entropy(h, w, t), atol=1e-5, rtol=1e-5)


def test_swiglu_fp16_and_a_block_boundary():
    g = torch.Generator().manual_seed(7)
    gate = torch.randn(1025, generator=g).half()  # one element past the first 1024-wide block
    up = torch.randn(1025, generator=g).half()
    _assert_same(triton_op("swiglu"), reference.swiglu, (gate, up), (0, 1), dtype=torch.float16)


def test_registered_through_the_registry_and_dispatched_by_predicate():
    """Registered on device type cpu here (interpreter), dispatch runs the Triton kernel only where supported."""
    from crosstrain.backends.triton.register import register_triton_kernels

    reg = KernelRegistry()
    reg._populated = True
    for name, (fn, doc) in reference.CORE_OPS.items():
        reg.declare(name, fn, doc)
    assert register_triton_kernels(reg, backend="test", device_type="cpu") == list(
        ["rms_norm", "rotary_embedding", "swiglu", "cross_entropy", "linear_cross_entropy", "grouped_mm",
         "moe_permute", "moe_unpermute"])
    x, w = torch.randn(4, 24), torch.randn(24)
    chosen = reg.resolve("rms_norm", x, w, 1e-6)
    assert chosen.__name__ == "triton_rms_norm"
    torch.testing.assert_close(chosen(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert reg.resolve("rms_norm", x.t().contiguous().t(), torch.randn(4), 1e-6) is reference.rms_norm  # strided
    assert reg.resolve("rms_norm", torch.randn(2, 20000), torch.randn(20000)) is reference.rms_norm  # too wide
    assert reg.resolve("swiglu", torch.randn(3), torch.randn(3).double()) is reference.swiglu  # dtype

    class Sub(torch.Tensor):  # stands for DTensor and other subclasses, whose storage a kernel must not read
        pass

    assert reg.resolve("swiglu", torch.randn(3).as_subclass(Sub), torch.randn(3)) is reference.swiglu


def test_torch_compile_traces_the_reference():
    """Under torch.compile dispatch picks the reference, which inductor then fuses (no graph break on the kernel)."""
    from crosstrain.backends.triton.register import register_triton_kernels

    reg = KernelRegistry()
    reg._populated = True
    for name, (fn, doc) in reference.CORE_OPS.items():
        reg.declare(name, fn, doc)
    register_triton_kernels(reg, backend="test", device_type="cpu")
    seen = []

    def f(g, u):
        seen.append(reg.resolve("swiglu", g, u))
        return reg.call("swiglu", g, u)

    g, u = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(f, backend="eager")(g, u), reference.swiglu(g, u))
    assert seen and all(fn is reference.swiglu for fn in seen)
    assert f(g, u) is not None and seen[-1].__name__ == "triton_swiglu"  # eager still takes the kernel
    cos = torch.randn(5, 4, requires_grad=True)
    assert reg.resolve("rotary_embedding", torch.randn(5, 2, 8), cos, cos.detach()) is reference.rotary_embedding
    assert reg.resolve("cross_entropy", torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long)) is (
        reference.cross_entropy)  # only [N, V] logits


def test_vendor_launch_configs_follow_warp_width(monkeypatch):
    """Logic test: the same thread budgets give half the warps on a ROCm build (wavefront 64)."""
    from crosstrain.backends.triton import launch

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    nvidia = [c.num_warps for c in launch.make_configs([128, 256, 512, 1024])]
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    amd = [c.num_warps for c in launch.make_configs([128, 256, 512, 1024])]
    assert launch.vendor() == "amd" and launch.warp_size() == 64
    assert nvidia == [4, 8, 16, 32] and amd == [2, 4, 8, 16]


def test_registration_imports_no_triton():
    code = (
        "import sys\n"
        "from crosstrain.kernels import registry\n"
        "impls = [i for op in registry.ops() for i in registry.impls(op) if i.backend in ('cuda', 'rocm')]\n"
        "assert len(impls) == 16, impls\n"
        "assert 'triton' not in sys.modules, 'triton imported at registration'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_linear_cross_entropy_chunk_size_bounds_the_logits_buffer():
    from crosstrain.backends.triton.cross_entropy import CHUNK_ELEMENTS, chunk_rows

    assert chunk_rows(8192, 128256) == 1024 and 1024 * 128256 <= CHUNK_ELEMENTS
    assert chunk_rows(3, 10) == 3 and chunk_rows(5, 10**9) == 1
    assert chunk_rows(100, 7, budget=64) == 8


def test_kernel_benchmark_dry_run_prints_table_and_json():
    """benchmarks/kernels.py --dry-run exercises the GPU benchmark's code paths on the CPU interpreter."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
    out = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"min_bandwidth_fraction", "min_speedup"} <= set(summary) and summary["dry_run"] is True
    errs = [r["max_err"] for r in summary["results"] if r["max_err"] is not None]
    assert len(errs) == 8 and max(errs) < 0.1  # bf16 kernels agree with the eager references


def test_every_kernel_compiles_for_sm90_and_gfx942(tmp_path):
    """Triton's real compiler (no GPU needed) lowers each kernel to a cubin and an hsaco: catches compiled-mode
    errors the interpreter lets through. Building is not running: speed and on-device results need a GPU."""
    import re
    from pathlib import Path

    from crosstrain.backends.triton.aot_check import KERNELS

    folder = Path(__file__).resolve().parents[1] / "backends" / "triton"
    declared = {m for f in folder.glob("*.py") for m in re.findall(r"@triton\.jit\ndef (\w+)", f.read_text())}
    assert declared == set(KERNELS), "aot_check.KERNELS must list every @triton.jit kernel"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-m", "crosstrain.backends.triton.aot_check"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert f"{2 * len(KERNELS)}/{2 * len(KERNELS)} kernels compiled" in out.stdout


def test_linear_cross_entropy_grad_for_one_input_only():
    h, w, t = _lce_inputs(8, 6, 40)
    fn = triton_op("linear_cross_entropy")
    for needs in ((True, False), (False, True)):
        a, b = h.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])
        ar, br = h.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])
        fn(a, b, t).backward()
        reference.linear_cross_entropy(ar, br, t).backward()
        for x, xr in ((a, ar), (b, br)):
            assert (x.grad is None) == (xr.grad is None)
            if x.grad is not None:
                torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_under_autocast_keeps_input_dtype():
    h, w, t = _lce_inputs(9, 5, 30)
    h, w = h.requires_grad_(), w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = triton_op("linear_cross_entropy")(h, w, t)
    loss.backward()
    hr, wr = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    reference.linear_cross_entropy(hr, wr, t).backward()  # fp32, outside autocast
    torch.testing.assert_close(h.grad, hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_grouped_mm_empty_groups_and_groups_spanning_tiles(dtype):
    """Groups of 0, 1, a full tile and more than one tile (BLOCK_M = 32); a group without rows gets zero grads."""
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([0, 1, 32, 45, 0])
    x = torch.randn(int(counts.sum()), 40, generator=g).to(dtype)
    w = (torch.randn(5, 40, 24, generator=g) / 40**0.5).to(dtype)
    _assert_same(triton_op("grouped_mm"), reference.grouped_mm, (x, w, counts), (0, 1), dtype)
    out, grads = _grads(triton_op("grouped_mm"), (x, w, counts), (0, 1))
    assert grads[1][0].abs().sum() == 0 and grads[1][4].abs().sum() == 0
    empty = triton_op("grouped_mm")(x[:0], w, torch.zeros(5, dtype=torch.long))
    assert empty.shape == (0, 24)


def test_grouped_mm_dispatch_predicate():
    from crosstrain.backends.triton.register import supports_grouped_mm

    ok = supports_grouped_mm("cpu")
    x, w, counts = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 4])
    assert ok(x, w, counts)
    assert not ok(x, w, counts.float()) and not ok(x, w.double(), counts) and not ok(x, w, torch.tensor([6]))
    assert not ok(x.t().contiguous().t(), w, counts)  # strided


def test_moe_permute_top1_ids_and_unpermute_weight_grads():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randn(9, 20, generator=g)
    ids = torch.randint(0, 3, (9,), generator=g)  # 1-D ids: top-1
    _assert_same(lambda t: triton_op("moe_permute")(t, ids, 3)[0], lambda t: reference.moe_permute(t, ids, 3)[0],
                 (tokens,), (0,))
    permuted, order, _ = reference.moe_permute(tokens, torch.randint(0, 3, (9, 2), generator=g), 3)
    weights = torch.rand(9, 2, generator=g)
    _assert_same(triton_op("moe_unpermute"), reference.moe_unpermute, (permuted, order, weights), (0, 2))
