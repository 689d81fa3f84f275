"""Issue 41's acceptance: the default ``crosstrain train`` (shortened through --set, its timed checkpoints made
frequent) killed with SIGKILL at 80% of its steps, then the same command with ``--run-dir``: it resumes from a
checkpoint minutes old at most and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from run_kill import sigkill_at_step

STEPS = 30
KILL_AT = STEPS * 8 // 10


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def test_sigkill_at_80_percent_then_the_same_command_resumes_to_the_same_weights(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "crosstrain",
        "train",
        "--set",
        f"train.steps={STEPS}",
        "--set",
        "checkpoint.every_minutes=0.002",
        "--set",
        "logging.progress=none",
    ]
    run, whole = tmp_path / "run", tmp_path / "whole"
    sigkill_at_step([*cmd, "--run-dir", str(run)], run, KILL_AT, _env(), timeout_s=300)
    killed_at = time.time()
    saved = sorted(
        int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp")
    )
    assert saved and saved[-1] < STEPS, saved
    assert killed_at - (run / "checkpoints" / f"step_{saved[-1]}").stat().st_mtime < 600

    resumed = subprocess.run([*cmd, "--run-dir", str(run)], env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    match = re.search(r"resumed from \S+step_(\d+) at step (\d+)", resumed.stderr)
    assert match and match.group(1) == match.group(2), resumed.stderr[-3000:]
    assert 0 < int(match.group(1)) <= saved[-1]

    plain = subprocess.run([*cmd, "--run-dir", str(whole)], env=_env(), capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    done, reference = (json.loads((d / "summary.json").read_text()) for d in (run, whole))
    assert done["steps"] == reference["steps"] == STEPS
    assert done["params_sha256"] == reference["params_sha256"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
