"""``crosstrain distill demo`` as a real process: its three phases print progress as they go and end with the held-out
NLLs; the first SIGTERM or SIGINT stops the running phase after its step with one line and exit 128 + signal, no
traceback and no later phase (a second signal as well); the stopped demo continues where it stopped when run again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: the demo's code path on a smaller model and fewer tokens: the test bounds the phases, not the defaults
SMALLER = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=32", "eval.max_batches=2",
           "eval.batch_size=4", "logging.every=2", "backend=cpu"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _demo(run_dir: Path, teacher_steps: int, steps: int) -> list[str]:
    argv = [sys.executable, "-m", "crosstrain", "distill", "demo", "--run-dir", str(run_dir),
            "--teacher-steps", str(teacher_steps), "--steps", str(steps)]
    for s in SMALLER:
        argv += ["--set", s]
    return argv


def test_demo_prints_each_phase_and_its_progress_then_the_three_nlls(tmp_path) -> None:
    run = tmp_path / "demo"
    proc = subprocess.run(_demo(run, 6, 4), capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    out = proc.stdout.splitlines()
    heads = [line for line in out if re.match(r"crosstrain: distill demo \d/3: ", line)]
    assert [h[len("crosstrain: distill demo "):][:3] for h in heads] == ["1/3", "2/3", "3/3"], out
    for total in (6, 4, 4):  # each phase's own progress lines, between its header and the next
        assert any(line.startswith(f"step 2/{total} | loss ") for line in out), out
    teacher_at = out.index(heads[0])
    baseline_at = out.index(heads[1])
    assert any(line.startswith("step 6/6 ") for line in out[teacher_at:baseline_at])
    result = json.loads(out[-1])
    assert result["eval_nll_teacher"] > 0 and result["eval_nll_baseline"] > 0 and result["eval_nll_student"] > 0
    assert result["kd_vs_ce"] == pytest.approx(result["eval_nll_student"] / result["eval_nll_baseline"])
    student = json.loads((run / "student" / "summary.json").read_text())
    baseline = json.loads((run / "baseline" / "summary.json").read_text())
    assert student["recipe"] == "distill" and baseline["recipe"] == "lm"
    assert student["distill"]["teacher"]["source"].endswith("step_6")

    again = subprocess.run(_demo(run, 6, 4), capture_output=True, text=True, env=_env(), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing the finished run") == 3  # nothing trained twice
    assert json.loads(again.stdout.splitlines()[-1]) == result


def _start_and_stop(run: Path, signals: list[signal.Signals]) -> tuple[subprocess.CompletedProcess, float]:
    """Start a long demo, wait for the teacher's second progress line, send ``signals`` (50 ms apart); the finished
    process and the seconds it took to exit after the first signal."""
    proc = subprocess.Popen(_demo(run, 100000, 100000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    assert proc.stdout is not None
    lines = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("step 4/100000 "):
            break
    assert proc.poll() is None, "".join(lines) + proc.communicate()[1][-3000:]
    sent = time.perf_counter()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.05)
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    took = time.perf_counter() - sent
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines) + out, err), took


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGTERM, signal.SIGTERM]],
                         ids=["sigterm", "sigint", "sigterm-twice"])
def test_a_signal_stops_the_demo_in_one_line_and_no_later_phase_starts(tmp_path, signals) -> None:
    run = tmp_path / "demo"
    proc, took = _start_and_stop(run, signals)
    assert proc.returncode == 128 + signals[0], (proc.returncode, proc.stderr[-3000:])
    assert took < 60, took  # a step of the smaller model, then the checkpoint: bounds a hang only
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"crosstrain: {signals[0].name} received"), lines
    assert lines[0].endswith(f"crosstrain distill demo --teacher-steps 100000 --steps 100000 "
                             f"{' '.join(f'--set {s}' for s in SMALLER)} --run-dir {run}"), lines
    assert "distill demo 2/3" not in proc.stdout and not (run / "baseline").exists()
    summary = json.loads((run / "teacher" / "summary.json").read_text())
    if len(signals) == 1:  # the trainer finished its step and saved it
        assert summary["preempted"] is True
        assert (run / "teacher" / "checkpoints" / f"step_{summary['steps']}").is_dir()
