"""benchmarks/models.py's account of where a step goes (issue 40): the per-op table adds up to the step, and the
timer of the native extensions times real kernel calls, leaves their results alone and is removed after the run."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from crosstrain.backends.cpu import native as native_optim
from crosstrain.backends.cpu.native import kernels as native

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "models.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_breakdown_splits_the_step_into_gemms_attention_each_large_op_and_the_rest(bench):
    flash = "_scaled_dot_product_flash_attention_for_cpu"
    floors = [{"ops": {"mm": 0.100, "addmm": 0.010, flash: 0.020, "add": 0.005, "ext:swiglu_bwd": 0.004,
                       "view": 0.0001}},
              {"ops": {"mm": 0.120, "addmm": 0.010, flash: 0.022, "add": 0.007, "ext:swiglu_bwd": 0.004,
                       "view": 0.0003}}]
    # medians over the rounds: GEMMs 0.11 + 0.01, attention 0.021, add 0.006; view (under 0.5% of the step) goes
    # to "other ops"; "timed ops" sums every op (0.1512 s)
    assert bench.breakdown(0.2, floors) == pytest.approx(
        {"gemm": 120.0, "attention": 21.0, "add": 6.0, "ext:swiglu_bwd": 4.0, "other ops": 0.2, "timed ops": 151.2})


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")
def test_timed_extension_times_each_call_and_keeps_its_result(bench):
    spent: dict[str, float] = {}
    ticks = iter(range(100))  # a clock that moves by 1 at each reading
    timed = bench._TimedExtension(native._ext, lambda: float(next(ticks)), spent)
    gate, up = torch.randn(4, 97), torch.randn(4, 97)
    out, ref = torch.empty_like(gate), torch.empty_like(gate)
    timed.swiglu_fwd(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), 0, 1)
    native._ext.swiglu_fwd(gate.data_ptr(), up.data_ptr(), ref.data_ptr(), gate.numel(), 0, 1)
    assert torch.equal(out, ref) and spent == {"ext:swiglu_fwd": 1.0}
    assert timed.openmp == native._ext.openmp  # what is not a function passes through


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")
def test_bound_run_times_every_op_and_native_kernel_then_restores_the_extensions(bench, tmp_path):
    args = argparse.Namespace(preset="tiny", batch=2, seq=16, steps=4, warmup=1, threads=1, compile="false",
                              clock="cpu")
    floor = bench.irreducible("native", args)
    ops = floor["ops"]
    assert ops["mm"] > 0 and floor["gemm"] <= floor["irreducible"]
    assert {"ext:swiglu_fwd", "ext:swiglu_bwd", "ext:rms_norm_fwd", "ext:adamw_step"} <= set(ops)
    assert isinstance(native._ext, ModuleType) and isinstance(native_optim._native, ModuleType)
