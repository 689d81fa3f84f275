"""The CPU peak FLOP/s that MFU divides by: measured with the run's op and threads, a cached figure measured under
load is corrected, summary.json records the figure and its source, and a slow precision gets a warning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from crosstrain.backends.cpu import peak
from crosstrain.backends.cpu.device import CpuDevice, SlowPrecisionWarning
from crosstrain.cli.main import main
from crosstrain.config import load_config
from crosstrain.engine import Trainer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CROSSTRAIN_PEAK_FLOPS", raising=False)
    return tmp_path / "cache" / "crosstrain" / "cpu_peak_flops.json"


def _seed(cache, flops_by_dtype: dict[torch.dtype, float]) -> None:
    threads = torch.get_num_threads()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"version": peak.CACHE_VERSION, "peaks": {
        peak.key(dtype, threads): {"flops": flops} for dtype, flops in flops_by_dtype.items()}}))


def test_a_figure_cached_under_load_is_measured_again(cache) -> None:
    _seed(cache, {torch.float32: 1e6})  # 1 MFLOP/s: what a trial on a swamped machine could leave behind
    rng = torch.get_rng_state()
    found = peak.peak(torch.float32)
    assert torch.equal(torch.get_rng_state(), rng)  # measuring never moves the run's random stream
    assert found.flops > 1e8 and found.source.startswith("measured now (F.linear 1024x1024 float32")
    stored = json.loads(cache.read_text())["peaks"][peak.key(torch.float32, torch.get_num_threads())]
    assert stored["flops"] == found.flops
    assert peak.key(torch.float32, 3) == f"{peak.cpu_model()} | {peak.isa()} | 3 thread(s) | float32"


def test_a_plausible_cached_figure_is_used_and_the_old_format_ignored(cache) -> None:
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"x86_64-host-1t-bfloat16": 1.24e9}))  # the old torch.mm cache
    assert peak.peak(torch.float32).source.startswith("measured now")
    _seed(cache, {torch.float32: 1e15})  # no trial here beats it
    found = peak.peak(torch.float32)
    assert found.flops == 1e15 and found.source.startswith("cached measurement (F.linear")


def test_a_precision_far_slower_than_fp32_warns(cache) -> None:
    _seed(cache, {torch.float32: 1e15, torch.bfloat16: 1e13})
    with pytest.warns(SlowPrecisionWarning, match=r"bfloat16 matrix multiplies run at 10000\.0 GFLOP/s on this CPU, "
                                                  r"100\.0x slower than fp32"):
        assert CpuDevice().peak_flops(torch.bfloat16) == 1e13
    _seed(cache, {torch.float32: 1e15, torch.bfloat16: 9e14})
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        CpuDevice().peak_flops(torch.bfloat16)


def test_summary_records_the_peak_and_its_source(cache, tmp_path, monkeypatch) -> None:
    opts = ["train.steps=2", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu"]
    summary = Trainer(load_config(None, opts), run_dir=tmp_path / "a").fit()
    written = json.loads((tmp_path / "a" / "summary.json").read_text())["peak_flops"]
    assert written == summary["peak_flops"] and written["flops"] > 0 and "F.linear" in written["source"]
    assert summary["mfu"] > 0
    monkeypatch.setenv("CROSSTRAIN_PEAK_FLOPS", "fp32=2e12")
    summary = Trainer(load_config(None, opts), run_dir=tmp_path / "b").fit()
    assert summary["peak_flops"] == {"flops": 2e12, "source": "$CROSSTRAIN_PEAK_FLOPS"}


def test_doctor_measure_replaces_the_cached_figures(cache, capsys) -> None:
    _seed(cache, {torch.float32: 1e15})
    assert main(["doctor", "--measure", "--json"]) == 0
    cpu = json.loads(capsys.readouterr().out)["peak_flops"]["cpu"]
    assert set(cpu) == {"fp32", "bf16", "fp16"}
    assert 0 < cpu["fp32"]["flops"] < 1e15 and cpu["fp32"]["source"].startswith("measured now")
    assert json.loads(cache.read_text())["peaks"][peak.key(torch.float32, torch.get_num_threads())]["flops"] < 1e15
