"""Shared by the kill-and-resume tests: start a training command and SIGKILL it once a checkpoint is committed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def sigkill_after_checkpoint(cmd: list[str], run_dir: Path, step: int, env: dict[str, str],
                             timeout_s: float, poll_s: float = 0.005) -> None:
    """Run ``cmd`` in its own process group, kill the whole group with SIGKILL as soon as
    ``run_dir/checkpoints/step_<step>`` exists, and check that the run had not finished by then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    deadline = time.time() + timeout_s
    while not (run_dir / "checkpoints" / f"step_{step}").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(poll_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"
