"""``crosstrain tune --throughput`` end to end: every candidate of the grid is a real run, the knobs it searches
leave what is trained unchanged (equal losses at every step), and the winner comes back as valid ``--set`` flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from test_tune_kill import TINY, _sets  # noqa: E402


def test_throughput_search_runs_the_grid_and_keeps_the_result(tmp_path: Path) -> None:
    from crosstrain.config import load_config

    out = tmp_path / "out"
    base = [s for s in TINY if not s.startswith(("train.steps", "eval.", "train.batch_size"))] + ["train.batch_size=2"]
    done = subprocess.run([sys.executable, "-m", "crosstrain", "tune", "--throughput", "--out", str(out), "--json",
                           *_sets(base)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    trials = found["trials"]
    # batch 2 on one process: grad_accum 1 or 2, activation checkpointing none or full
    assert sorted((t["params"]["train.grad_accum"], t["params"]["parallel.activation_checkpoint"]) for t in trials) == [
        (1, "full"), (1, "none"), (2, "full"), (2, "none")]
    assert all(t["tokens_per_s"] > 0 for t in trials)
    best = max(trials, key=lambda t: t["tokens_per_s"])
    assert found["tokens_per_s"] == best["tokens_per_s"] and found["base_tokens_per_s"] is not None
    current = {"train.grad_accum": 1, "parallel.activation_checkpoint": "none"}
    assert found["set"] == [f"{k}={v}" for k, v in best["params"].items() if current[k] != v]
    losses = []
    for t in trials:
        summary = json.loads((Path(t["run_dir"]) / "summary.json").read_text())
        assert summary["steps"] == 10
        losses.append(summary["losses"])
    for other in losses[1:]:  # the knobs change the speed, not the run
        assert other == pytest.approx(losses[0], rel=1e-5)
    load_config(None, [*base, *found["set"]])  # the flags it prints are a valid config
