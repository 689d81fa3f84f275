"""MoE checkpoints reshard across ep sizes (2 real gloo ranks through the CLI): a run at ep=2 resumed at ep=1 from
its step-2 checkpoint, and that run's step-4 checkpoint resumed at ep=2 again, continue the ep=2 run's losses
within 1e-5 (expert weights are DTensors whose global shape does not depend on ep)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOL = 1e-5
COMMON = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "schedule.warmup_steps=0",
          "model.n_layers=2", "moe.experts=4", "moe.capacity_factor=1.5", "checkpoint.every=2",
          "checkpoint.keep_last=10", "backend=cpu", "parallel.dp_shard=2"]  # FSDP2 (+ ep) at every ep


def _train(out: Path, ep: int, steps: int, resume: Path | None = None) -> tuple[Path, list[float]]:
    sets = [*COMMON, f"parallel.ep={ep}", f"train.steps={steps}", f"train.output_dir={out}"]
    if resume is not None:
        sets.append(f"checkpoint.resume={resume}")
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next(out.iterdir())
    return run, json.loads((run / "summary.json").read_text())["losses"]


def test_checkpoints_reshard_between_ep2_and_ep1(tmp_path):
    a, losses = _train(tmp_path / "a", ep=2, steps=6)
    # the same train.steps everywhere: the LR schedule depends on it
    b, resumed = _train(tmp_path / "b", ep=1, steps=6, resume=a / "checkpoints" / "step_2")
    assert len(resumed) == 4
    for got, want in zip(resumed, losses[2:], strict=True):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), (resumed, losses)
    _, back = _train(tmp_path / "c", ep=2, steps=6, resume=b / "checkpoints" / "step_4")
    for got, want in zip(back, losses[4:6], strict=True):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), (back, losses)
