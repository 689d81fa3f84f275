"""LOGIC TESTS, not hardware tests: cuda/rocm/npu detection, selection and peak tables under simulated
environments (a ROCm-flagged torch, a CUDA-flagged torch with N devices, a stand-in ``torch_npu``, no devices).

They check the decisions crosstrain makes from what torch reports; they cannot show that a real GPU or NPU
works. Hardware verification is ``scripts/gpu_check.sh`` (see docs/backends.md for what has been run where).
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from crosstrain import registry
from crosstrain.backends.cuda.backend import CudaBackend
from crosstrain.backends.cuda.device import CudaDevice
from crosstrain.backends.cuda.specs import NVIDIA_PARTS, find_part, measure_matmul_flops
from crosstrain.backends.npu.backend import NpuBackend
from crosstrain.backends.npu.device import NpuDevice
from crosstrain.backends.rocm.backend import RocmBackend
from crosstrain.backends.rocm.device import RocmDevice
from crosstrain.backends.rocm.specs import AMD_PARTS
from crosstrain.errors import BackendUnavailableError, ConfigError


def simulate_torch(monkeypatch, *, cuda: str | None, hip: str | None, devices: int, name: str = "",
                   capability: tuple[int, int] = (9, 0), bf16: bool = True) -> None:
    """Make this CPU torch report a CUDA or ROCm build with ``devices`` GPUs (no GPU call is made for real)."""
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
                "CROSSTRAIN_PEAK_FLOPS", "CROSSTRAIN_BACKEND"):
        monkeypatch.delenv(var, raising=False)


# --- this machine: a CPU build of torch ---------------------------------------------------------------------

def test_cpu_build_explains_why_each_accelerator_is_unavailable(clean_env):
    if torch.version.cuda or torch.version.hip:
        pytest.skip("this torch is a GPU build")
    assert "built without CUDA" in CudaDevice().availability().reason
    assert "built without ROCm/HIP" in RocmDevice().availability().reason
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is not available: torch .* built without CUDA"):
        registry.select_backend("cuda")
    assert registry.select_backend("auto").backend.name == "cpu"


# --- simulated CUDA / ROCm builds ---------------------------------------------------------------------------

def test_rocm_build_claims_the_gpu_and_cuda_steps_aside(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda=None, hip="6.2.41133", devices=2, name="AMD Instinct MI300X")
    cuda, rocm = CudaBackend(), RocmBackend()
    assert not cuda.availability() and "torch is a ROCm build" in cuda.availability().reason
    assert rocm.availability().available
    assert rocm.device().type == "cuda" and rocm.device().dist_backend == "nccl"
    assert rocm.device().device_count() == 2
    sel = registry.select_backend("auto")
    assert sel.backend.name == "rocm"
    assert ("cuda", False) in [(n, ok) for n, ok, _ in sel.probes]
    with pytest.raises(BackendUnavailableError, match="torch is a ROCm build"):
        registry.select_backend("cuda")


def test_cuda_build_claims_the_gpu_and_rocm_steps_aside(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda="12.6", hip=None, devices=4, name="NVIDIA H100 80GB HBM3")
    cuda, rocm = CudaBackend(), RocmBackend()
    assert cuda.availability().available and cuda.device().device_count() == 4
    assert "torch is a CUDA build (CUDA 12.6), not ROCm" in rocm.availability().reason
    assert registry.select_backend("auto").backend.name == "cuda"


@pytest.mark.parametrize("hip", [None, "6.2"])
def test_never_both_claim_one_gpu(monkeypatch, clean_env, hip):
    simulate_torch(monkeypatch, cuda=None if hip else "12.4", hip=hip, devices=1)
    assert [CudaBackend().availability().available, RocmBackend().availability().available].count(True) == 1


def test_no_visible_device_names_the_variable(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert CudaDevice().availability().reason == (
        "no CUDA device visible (CUDA_VISIBLE_DEVICES=''); check the NVIDIA driver with nvidia-smi")
    simulate_torch(monkeypatch, cuda=None, hip="6.2", devices=0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "7")
    reason = RocmDevice().availability().reason
    assert reason.startswith("no ROCm device visible (HIP_VISIBLE_DEVICES='7')") and "rocm-smi" in reason


def test_rocm_visible_devices_falls_back_to_cuda_variable(monkeypatch, clean_env):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert RocmDevice().visible_devices() == "0,1"
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert RocmDevice().visible_devices() == "1"
    assert CudaDevice().visible_devices_env == "CUDA_VISIBLE_DEVICES"


def test_capabilities_follow_the_part(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, capability=(9, 0))
    assert {"fp8", "bf16", "streams", "graph_capture", "pinned_memory"} <= CudaBackend().capabilities
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, capability=(8, 0))
    caps = CudaBackend().capabilities
    assert "bf16" in caps and "fp8" not in caps
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, capability=(7, 0), bf16=False)
    caps = CudaBackend().capabilities
    assert "bf16" not in caps and "fp8" not in caps
    assert CudaDevice().autocast_dtype() == torch.float16


def test_rocm_fp8_by_architecture(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda=None, hip="6.2", devices=1)
    for arch, fp8 in (("gfx942:sramecc+:xnack-", True), ("gfx90a:sramecc+:xnack-", False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, a=arch: types.SimpleNamespace(gcnArchName=a))
        assert ("fp8" in RocmBackend().capabilities) is fp8


# --- peak FLOP/s -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_name,part", [
    ("NVIDIA A100-SXM4-80GB", "A100 80GB"), ("NVIDIA A100 80GB PCIe", "A100 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA B200", "B200"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_nvidia_part_matching(device_name, part):
    assert find_part(device_name, NVIDIA_PARTS).name == part


@pytest.mark.parametrize("device_name,part", [
    ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI325X", "MI325X"), ("AMD Instinct MI250X/MI250", "MI250X"),
])
def test_amd_part_matching(device_name, part):
    assert find_part(device_name, AMD_PARTS).name == part


def test_unknown_parts_do_not_match():
    assert find_part("NVIDIA GeForce GTX 1080", NVIDIA_PARTS) is None
    assert find_part("NVIDIA L40", NVIDIA_PARTS) is None  # L40 is not an L40S
    assert find_part("AMD Radeon RX 7900 XTX", AMD_PARTS) is None


def test_peak_flops_from_table_dtype_and_missing_fp8(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, name="NVIDIA H100 80GB HBM3")
    dev = CudaDevice()
    h100 = find_part("NVIDIA H100 80GB HBM3", NVIDIA_PARTS)
    assert dev.peak_flops(torch.bfloat16) == h100.flops["bf16"]
    assert dev.peak_flops(torch.float8_e4m3fn) == h100.flops["fp8"]
    assert dev.peak_flops(torch.float32) == h100.flops["fp32"] < dev.peak_flops(torch.bfloat16)
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, name="NVIDIA A100-SXM4-80GB")
    assert dev.peak_flops(torch.float8_e4m3fn) == 0.0  # A100 has no fp8 tensor cores


def test_peak_flops_override(monkeypatch, clean_env):
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, name="NVIDIA H200")
    dev = CudaDevice()
    monkeypatch.setenv("CROSSTRAIN_PEAK_FLOPS", "1.5e15")
    assert dev.peak_flops(torch.float32) == dev.peak_flops(torch.bfloat16) == 1.5e15
    monkeypatch.setenv("CROSSTRAIN_PEAK_FLOPS", "bf16=2e15, fp32=1e14")
    assert dev.peak_flops(torch.bfloat16) == 2e15 and dev.peak_flops(torch.float32) == 1e14
    assert dev.peak_flops(torch.float16) == find_part("NVIDIA H200", NVIDIA_PARTS).flops["fp16"]  # not overridden
    monkeypatch.setenv("CROSSTRAIN_PEAK_FLOPS", "fast")
    with pytest.raises(ConfigError, match="CROSSTRAIN_PEAK_FLOPS='fast'"):
        dev.peak_flops(torch.bfloat16)


def test_unknown_part_falls_back_to_a_measured_matmul(monkeypatch, clean_env):
    """The fallback really measures: here on the host (the simulated GPU's 'current device' is the CPU)."""
    simulate_torch(monkeypatch, cuda="12.4", hip=None, devices=1, name="NVIDIA Future GPU")
    dev = CudaDevice()
    monkeypatch.setattr(dev, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr("crosstrain.backends.cuda.specs.measure_matmul_flops",
                        lambda d, dt: measure_matmul_flops(d, dt, n=128, iters=2))
    peak = dev.peak_flops(torch.float32)
    assert peak > 1e6


# --- NPU with a stand-in torch_npu ---------------------------------------------------------------------------

def stand_in_torch_npu(monkeypatch, devices: int, name: str = "Ascend910B3") -> types.ModuleType:
    """A module object named torch_npu that registers a fake ``torch.npu`` with ``devices`` devices.

    The ops follow torch_npu's documented formulas (see crosstrain.backends.npu.kernels), computed with torch on
    the CPU, so the tests check crosstrain's argument plumbing against the reference semantics.
    """
    npu = types.SimpleNamespace(
        device_count=lambda: devices, current_device=lambda: 0, get_device_name=lambda i=None: name,
        is_available=lambda: devices > 0,
    )
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu = npu

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        assert x.dtype == gamma.dtype, "torch_npu.npu_rms_norm needs gamma in x's dtype"
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        assert x.dim() == 4 and r1.shape == r2.shape == (1, x.shape[1], 1, x.shape[3])
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    def npu_swiglu(x, dim=-1):
        a, b = torch.chunk(x, 2, dim=dim)
        return torch.nn.functional.silu(a) * b

    mod.npu_rms_norm, mod.npu_rotary_mul, mod.npu_swiglu = npu_rms_norm, npu_rotary_mul, npu_swiglu
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return mod


def test_npu_without_torch_npu(monkeypatch, clean_env):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import system: "not installed"
    assert NpuDevice().availability().reason == "torch_npu is not installed (it needs Ascend CANN)"
    with pytest.raises(BackendUnavailableError, match=r"pip install 'crosstrain\[npu\]'"):
        registry.select_backend("npu")


def test_npu_import_failure_is_reported(tmp_path, monkeypatch, clean_env):
    (tmp_path / "torch_npu.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    reason = NpuDevice().availability().reason
    assert reason == "import torch_npu failed: ImportError: libhccl.so: cannot open shared object file"


def test_npu_with_stand_in(monkeypatch, clean_env):
    stand_in_torch_npu(monkeypatch, devices=8)
    backend = NpuBackend()
    dev = backend.device()
    assert dev.availability().available and dev.device_count() == 8
    assert (dev.type, dev.dist_backend, dev.visible_devices_env) == ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    assert dev.peak_flops(torch.bfloat16) == 313e12
    assert registry.select_backend("auto").backend.name == "npu"  # no GPU build here, so npu outranks cpu


def test_npu_no_device(monkeypatch, clean_env):
    stand_in_torch_npu(monkeypatch, devices=0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    reason = NpuDevice().availability().reason
    assert reason.startswith("no Ascend NPU visible (ASCEND_RT_VISIBLE_DEVICES='')")


@pytest.mark.parametrize("op", ["rms_norm", "rotary_embedding", "swiglu"])
@pytest.mark.parametrize("rows,width", [(1, 8), (7, 97), (33, 256)])
def test_npu_kernels_follow_reference_through_documented_ops(monkeypatch, op, rows, width):
    from crosstrain.backends.npu.kernels import NPU_OPS
    from crosstrain.kernels import reference
    from crosstrain.testing.op_inputs import compare_with_reference

    stand_in_torch_npu(monkeypatch, devices=1)
    fn, _ = NPU_OPS[op]
    compare_with_reference(fn, reference.CORE_OPS[op][0], op, torch.device("cpu"), torch.float32, rows, width)


def test_npu_supports_predicates():
    from crosstrain.backends.npu.kernels import supports_rms_norm, supports_rotary, supports_swiglu

    x = torch.randn(2, 8)
    assert not supports_rms_norm(x, torch.ones(8))  # host tensors never go to torch_npu
    assert not supports_swiglu(x, x)
    assert not supports_rotary(torch.randn(1, 4, 2, 8), torch.randn(4, 4), torch.randn(4, 4))


def test_import_crosstrain_never_imports_torch_npu(tmp_path):
    """A real subprocess with a torch_npu that leaves a mark when imported: discovery and kernel registration
    must not import it; probing the npu backend does (and then reports what the module says)."""
    mark = tmp_path / "imported"
    (tmp_path / "torch_npu.py").write_text(textwrap.dedent(f"""
        open({str(mark)!r}, "w").close()
        raise ImportError("stand-in: no CANN here")
    """))
    code = textwrap.dedent(f"""
        import os, sys
        import crosstrain
        from crosstrain import registry
        from crosstrain.kernels import registry as kernels
        registry.backends(); kernels.ops()
        assert not os.path.exists({str(mark)!r}), "torch_npu imported during discovery"
        assert "torch_npu" not in sys.modules
        print(registry.get_backend("npu").availability().reason)
        assert os.path.exists({str(mark)!r})
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "import torch_npu failed: ImportError: stand-in: no CANN here"
