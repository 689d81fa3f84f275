"""The default ``crosstrain train`` on simdev (a software device whose tensors are not host memory) equals the cpu
backend: same losses (fp32, ``kernels.mode=reference``, ``optim.impl=torch``; asserted to rel 1e-6, measured bit
for bit) and the same ``params_sha256``; a checkpoint written on one backend resumes on the other to the same
parameters. simdev is a test device, not hardware: this proves the core never assumes the host, not a chip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="simdev's device memory is Linux memfd mappings")

STEPS = 6
COMMON = ["--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "logging.progress=none",
          "--set", "logging.tensorboard=false", "--set", "precision.dtype=fp32", "--set", "kernels.mode=reference",
          "--set", "optim.impl=torch", "--set", "checkpoint.every=3", "--set", f"train.steps={STEPS}"]


#: a device capacity (SIMDEV_MEMORY_GB) half of what the test model needs on one device (3.56 MiB peak): it fits
#: with FSDP over two devices, activation checkpointing and the optimizer state in host memory (1.56 MiB per
#: device; without the offload it does not)
SMALL_DEVICE_GB = str(1.75 / 1024)
FITS = ("parallel.dp_shard=2", "parallel.activation_checkpoint=full", "optim.offload=true")


def _launch(backend: str, run_dir: Path, *extra: str, memory_gb: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(CROSSTRAIN_BACKEND=backend, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if memory_gb:
        env["SIMDEV_MEMORY_GB"] = memory_gb
    cmd = [sys.executable, "-m", "crosstrain", "train", *COMMON, "--run-dir", str(run_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _train(backend: str, run_dir: Path, *extra: str, memory_gb: str | None = None) -> dict:
    out = _launch(backend, run_dir, *extra, memory_gb=memory_gb)
    assert out.returncode == 0, f"{out.args}\n{out.stdout}\n{out.stderr}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == backend
    return summary


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("simdev_train")
    return {b: (root / b, _train(b, root / b)) for b in ("cpu", "simdev")}


def test_default_run_on_simdev_equals_cpu(straight):
    cpu, sim = straight["cpu"][1], straight["simdev"][1]
    assert len(sim["losses"]) == len(cpu["losses"]) == STEPS
    assert sim["losses"] == pytest.approx(cpu["losses"], rel=1e-6)
    assert sim["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-6)
    assert sim["params_sha256"] == cpu["params_sha256"]
    # the peak is the device's own counter on simdev, not the host process's memory
    assert 0 < sim["peak_memory_bytes"] < cpu["peak_memory_bytes"]


@pytest.mark.parametrize(("saved_on", "resumed_on"), [("simdev", "cpu"), ("cpu", "simdev")])
def test_checkpoint_resumes_across_backends(straight, tmp_path, saved_on, resumed_on):
    step_3 = straight[saved_on][0] / "checkpoints" / "step_3"
    resumed = _train(resumed_on, tmp_path / "resumed", "--set", f"checkpoint.resume={step_3}")
    assert resumed["steps_this_run"] == STEPS - 3
    assert resumed["params_sha256"] == straight[resumed_on][1]["params_sha256"]
    assert resumed["losses"][-1] == pytest.approx(straight[resumed_on][1]["losses"][-1], rel=1e-6)


def test_a_run_that_does_not_fit_one_device_is_one_line_naming_the_fix(tmp_path):
    out = _launch("simdev", tmp_path / "run", "--set", "train.steps=2", memory_gb=SMALL_DEVICE_GB)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("crosstrain: error: the run does not fit in device memory (simdev out of memory. ")
    for fix in ("parallel.dp_shard=N", "parallel.activation_checkpoint=full", "optim.offload=true"):
        assert fix in last
    assert "Traceback" not in out.stderr


EP_MOE = ("parallel.dp_shard=2", "parallel.ep=2", "moe.experts=4")


@pytest.mark.parametrize("layout", [FITS, ("parallel.tp=2",), ("parallel.pp=2",), EP_MOE],
                         ids=["fsdp_fits", "tp", "pp", "ep_moe"])
def test_two_process_layouts_on_simdev_equal_cpu(straight, tmp_path, layout):
    # FSDP2 (with activation checkpointing and optimizer offload: then the run fits the small device), tensor
    # parallel, pipeline parallel (stages exchange activations by simgloo's posted send/recv) and expert parallel
    # (MoE, all_to_all) on two processes, collectives staged through gloo (simgloo)
    sets = [arg for key in layout for arg in ("--set", key)]
    memory = SMALL_DEVICE_GB if layout == FITS else None
    runs = {b: _train(b, tmp_path / b, "--nproc", "2", *sets, "--set", "train.steps=3", "--set", "checkpoint.every=0",
                      memory_gb=memory if b == "simdev" else None) for b in ("cpu", "simdev")}
    assert runs["simdev"]["losses"] == pytest.approx(runs["cpu"]["losses"], rel=1e-6)
    assert runs["simdev"]["params_sha256"] == runs["cpu"]["params_sha256"]
    if memory:
        capacity = runs["simdev"]["memory_capacity_bytes"]
        assert capacity == int(float(memory) * 2**30)
        assert len(runs["simdev"]["peak_memory_bytes_per_rank"]) == 2
        assert all(0 < peak <= capacity for peak in runs["simdev"]["peak_memory_bytes_per_rank"])
        assert straight["simdev"][1]["peak_memory_bytes"] > 1.9 * capacity  # the model needs ~2x one device
