"""A run keeps what it trained: a final checkpoint by default, a rejected resume or a re-run of a finished run
changes no file of the run dir, and a diverging run stops with an error instead of "done" on a ruined model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from nan_steps import NaNSteps

from crosstrain import pluginmanager
from crosstrain.cli.main import main

SMALL = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "logging.tensorboard=false",
         "schedule.warmup_steps=2", "backend=cpu"]


def _train(run_dir: Path, *sets: str) -> list[str]:
    return ["train", *[a for s in [*SMALL, *sets] for a in ("--set", s)], "--run-dir", str(run_dir)]


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_default_run_keeps_a_final_checkpoint_that_export_generate_and_resume_use(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(run, "train.steps=3")) == 0
    assert (run / "checkpoints" / "step_3").is_dir()
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run), "--format", "safetensors", "--out", str(out)]) == 0 and out.is_file()
    assert main(["generate", str(run), "--engine", "torch", "--prompt", "The ", "--max-new-tokens", "4"]) == 0
    assert main(_train(run, "train.steps=5")) == 0
    err = capsys.readouterr().err
    assert f"resumed from {run / 'checkpoints' / 'step_3'} at step 3" in err
    assert json.loads((run / "summary.json").read_text())["steps_this_run"] == 2
    # turned off: no checkpoint at the end
    assert main(_train(tmp_path / "off", "train.steps=2", "checkpoint.final=false")) == 0
    assert not list((tmp_path / "off" / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("change, needle", [
    (["model.n_layers=3"], "lacks"),
    (["model.dim=96", "model.n_heads=4"], "shape mismatch"),
])
def test_rejected_resume_changes_no_file_of_the_run(tmp_path, capsys, change, needle) -> None:
    run = tmp_path / "run"
    assert main(_train(run, "train.steps=2")) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(_train(run, "train.steps=4", *change)) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("crosstrain: error: ") and needle in err[0], err
    assert snapshot(run) == before
    assert main(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "m.safetensors")]) == 0


def test_rerunning_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(_train(run, "train.steps=3")) == 0
    before = snapshot(run)
    capsys.readouterr()
    for steps in (3, 2):
        assert main(_train(run, f"train.steps={steps}")) == 0  # nothing to do is not a failure
        captured = capsys.readouterr()
        assert "done" not in captured.out
        (line,) = captured.err.strip().splitlines()
        assert "already complete at step 3" in line and "raise train.steps" in line, line
        assert snapshot(run) == before


def test_a_run_ending_in_non_finite_steps_is_not_done(tmp_path, capsys) -> None:
    pluginmanager.register(NaNSteps(first=4), name="nan-from-4")
    try:
        code = main(_train(tmp_path / "run", "train.recipe=lm_nan", "train.steps=5",
                           "fault.max_consecutive_nonfinite=5"))
    finally:
        pluginmanager.unregister("nan-from-4")
    captured = capsys.readouterr()
    assert code == 1 and "done" not in captured.out
    (line,) = captured.err.strip().splitlines()
    assert "training ended at step 5 with a non-finite loss" in line and "lower optim.lr" in line


def test_diverging_resume_stops_after_max_rollbacks_and_keeps_the_good_checkpoint(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    # Reference kernels: at lr=1e9 the scenario needs step 6 to overflow already, so that step 4 is the checkpoint
    # before the first non-finite streak (the native CPU kernels stay finite one step longer at this scale).
    keep = ["checkpoint.every=2", "checkpoint.keep_last=2", "kernels.mode=reference"]
    assert main(_train(run, "train.steps=4", *keep)) == 0
    good = snapshot(run / "checkpoints" / "step_4")
    capsys.readouterr()
    code = main(_train(run, "train.steps=60", "optim.lr=1e9", "fault.max_consecutive_nonfinite=2",
                       "fault.max_rollbacks=2", *keep))
    captured = capsys.readouterr()
    assert code == 1 and "done" not in captured.out
    error = captured.err.strip().splitlines()[-1]
    assert error.startswith("crosstrain: error: loss or gradients non-finite again at step ")
    assert "after 2 rollback(s) (fault.max_rollbacks=2)" in error and "lower optim.lr (now 1e+09)" in error
    assert captured.err.count("rolled back model and optimizer") == 2
    # keep_last=2 saw newer checkpoints, but the last one before the first non-finite streak survives intact
    assert snapshot(run / "checkpoints" / "step_4") == good
    assert len(list((run / "checkpoints").glob("step_*"))) >= 3
