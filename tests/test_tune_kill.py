"""``crosstrain tune`` end to end on real processes: a tuner killed with SIGKILL during a trial leaves no process;
the same command then resumes that trial from its checkpoint (its weights equal an uninterrupted run's), prunes the
next one at its first evaluation (stopped there, checkpoint kept) and ends with exactly N trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from in_process import crosstrain_main  # noqa: E402

TINY = ["train.steps=12", "eval.every=4", "eval.steps=2", "train.batch_size=4", "train.seq_len=32",
        "model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.threads=1", "logging.tensorboard=false",
        "logging.progress=none", "backend=cpu"]
# trial 0 is the base config (optim.lr 3e-3); the seeded random sampler then draws 1e-5, which the median pruner
# (one startup trial) stops at its first evaluation
SPACE = """[tune]
sampler = "random"
seed = 0
startup_trials = 1
[space]
"optim.lr" = { choices = [0.003, 1e-5] }
"""


def _sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(pid))
    return found


def test_sigkill_then_same_command_resumes_exactly_and_prunes(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SPACE)
    cmd = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "2", "--out", str(out), "--json",
           *_sets(TINY)]
    trial0 = out / "space" / "trial_0000"
    tuner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (trial0 / "checkpoints" / "step_4").is_dir() and tuner.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(tuner.pid, signal.SIGKILL)  # the tuner only: its trial must die with it
    tuner.wait(timeout=60)
    assert not (trial0 / "summary.json").exists(), "trial 0 finished before the tuner could be killed"
    deadline = time.time() + 30
    while _processes_mentioning(str(out)) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(out)) == []

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert set(result) == {"study", "storage", "best_value", "best_params", "best_run_dir", "complete", "pruned",
                           "failed", "retried"}
    assert (result["complete"], result["pruned"], result["failed"]) == (1, 1, 0)
    assert "resuming trial 0" in again.stderr
    study = optuna.load_study(study_name="space", storage=result["storage"])
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1]  # exactly N, none duplicated
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert result["best_run_dir"] == str(trial0.resolve()) and result["best_params"] == {"optim.lr": 0.003}

    events = [json.loads(line) for line in (trial0 / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resume" and e["step"] >= 4 for e in events)
    resumed = json.loads((trial0 / "summary.json").read_text())
    ref_dir = tmp_path / "uninterrupted"
    assert crosstrain_main(["train", *_sets([*TINY, "optim.lr=0.003", "checkpoint.every=4"]),
                            "--run-dir", str(ref_dir)]) == 0
    reference = json.loads((ref_dir / "summary.json").read_text())
    assert resumed["params_sha256"] == reference["params_sha256"]
    assert resumed["eval_loss"] == pytest.approx(result["best_value"], abs=0)

    pruned_dir = out / "space" / "trial_0001"
    pruned = json.loads((pruned_dir / "summary.json").read_text())
    assert pruned["steps"] == 4 and pruned["preempted"]  # one process: it stops at the step it was pruned
    assert (pruned_dir / "checkpoints" / "step_4").is_dir()
    assert trials[1].user_attrs["pruned_at_step"] == 4 and trials[1].intermediate_values == {4: pytest.approx(
        trials[1].value)}

    assert crosstrain_main(["tune", "--report", str(out)]) == 0
    report = json.loads((out / "report" / "summary.json").read_text())
    assert (report["best_value"], report["best_run_dir"]) == (result["best_value"], result["best_run_dir"])
    assert [t["state"] for t in report["trials"]] == ["COMPLETE", "PRUNED"]
    for png in ("history.png", "intermediate.png"):
        assert (out / "report" / png).read_bytes()[:4] == b"\x89PNG"
    assert (out / "report" / "best_run" / "report.html").is_file()


SIX = """[tune]
pruner = "none"
sampler = "random"
[space]
"optim.lr" = { low = 1e-3, high = 3e-3, log = true }
"""


def test_sigkill_then_same_command_finishes_all_six_trials(tmp_path: Path) -> None:
    """Two deaths a tuner can die: SIGKILL during trial 1 (the real tuner process), and SIGKILL between asking
    Optuna for trial 2 and naming its run dir (a real process that asks as the tuner does and is killed there).
    Neither leaves a trial RUNNING forever: the same command ends with 6 of 6 trials COMPLETE."""
    import optuna
    from optuna.trial import TrialState

    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SIX)
    # 40 steps with a checkpoint every 2: the kill after the first checkpoint lands with 38 steps to go on any host
    # (with 4 steps a quiet host finished trial 1 in the 5 ms between the checkpoint and the kill)
    sets = _sets([s for s in TINY if not s.startswith(("train.steps", "eval.every"))] + [
        "train.steps=40", "eval.every=20", "checkpoint.every=2"])
    cmd = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "6", "--out", str(out), "--json", *sets]
    trial1 = out / "space" / "trial_0001"
    tuner = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (trial1 / "checkpoints" / "step_2").is_dir() and tuner.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(tuner.pid, signal.SIGKILL)
    tuner.wait(timeout=60)
    assert not (trial1 / "summary.json").exists(), "trial 1 finished before the tuner could be killed"
    deadline = time.time() + 30
    while _processes_mentioning(str(out)) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(out)) == []
    storage = f"sqlite:///{out.resolve() / 'tune.db'}"
    asker = subprocess.run([sys.executable, "-c", "import optuna, os, signal; optuna.load_study(study_name='space', "
                            f"storage={storage!r}).ask(); os.kill(os.getpid(), signal.SIGKILL)"], timeout=120)
    assert asker.returncode == -signal.SIGKILL
    study = optuna.load_study(study_name="space", storage=storage)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.RUNNING]

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert (result["complete"], result["pruned"], result["failed"], result["retried"]) == (6, 0, 0, 0)
    assert "resuming trial 1" in again.stderr and "starting trial 2" in again.stderr
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(6)) and all(t.state == TrialState.COMPLETE for t in trials)
    for t in trials:
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert summary["steps"] == 40 and summary["eval_loss"] == t.value
