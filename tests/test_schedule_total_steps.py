"""``schedule.total_steps``: a run trained in parts (4 steps, then resumed to 8) follows the one cosine decay of an
uninterrupted 8-step run, learning rate and loss at every step, and ends with its params_sha256."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from in_process import crosstrain_main
from one_line import one_line_error

from crosstrain.optim.schedules import lr_factor

BASE = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.batch_size=4", "train.seq_len=32",
        "schedule.name=cosine", "schedule.warmup_steps=2", "eval.every=0", "checkpoint.every=4", "logging.every=1",
        "logging.progress=none", "backend=cpu", "optim.lr=1e-2"]


def _train(run_dir: Path, *sets: str) -> dict:
    argv = ["train", "--run-dir", str(run_dir)]
    for s in (*BASE, *sets):
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    return json.loads((run_dir / "summary.json").read_text())


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"lr"' in x]


def test_a_run_trained_in_parts_follows_one_schedule(tmp_path: Path) -> None:
    whole = _train(tmp_path / "whole", "train.steps=8")
    _train(tmp_path / "parts", "train.steps=4", "schedule.total_steps=8")
    parts = _train(tmp_path / "parts", "train.steps=8", "schedule.total_steps=8")  # resumes from step 4
    assert parts["steps_this_run"] == 4 and parts["params_sha256"] == whole["params_sha256"]
    want = [1e-2 * lr_factor(s, total_steps=8, warmup_steps=2, name="cosine", min_lr_ratio=0.1) for s in range(8)]
    for run in ("whole", "parts"):
        rows = _rows(tmp_path / run)
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert [r["lr"] for r in rows] == pytest.approx(want), run
    assert [r["loss"] for r in _rows(tmp_path / "parts")] == [r["loss"] for r in _rows(tmp_path / "whole")]
    # without it the first part decays over its own 4 steps: at step 4 it is halfway down, not at 8 steps' value
    _train(tmp_path / "short", "train.steps=4")
    short = 1e-2 * lr_factor(3, total_steps=4, warmup_steps=2, name="cosine", min_lr_ratio=0.1)
    assert _rows(tmp_path / "short")[3]["lr"] == pytest.approx(short) and short < 0.6 * want[3]


def test_a_schedule_shorter_than_the_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--run-dir", str(tmp_path / "run")]
    for s in (*BASE, "train.steps=4", "schedule.total_steps=3"):
        argv += ["--set", s]
    assert crosstrain_main(argv) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.out, captured.err, lines=1)[0]
    assert "schedule.total_steps=3" in line and "train.steps=4" in line
    assert not (tmp_path / "run").exists()
