"""Shared by the kill-and-resume tests: start a training command and SIGKILL it at a chosen moment."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def sigkill_when(
    cmd: list[str],
    ready: Callable[[], bool],
    run_dir: Path,
    env: dict[str, str],
    timeout_s: float,
    poll_s: float = 0.005,
) -> None:
    """Run ``cmd`` in its own process group, kill the whole group with SIGKILL as soon as ``ready()``, and check
    that the run had not finished by then."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + timeout_s
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(poll_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"


def sigkill_after_checkpoint(
    cmd: list[str], run_dir: Path, step: int, env: dict[str, str], timeout_s: float, poll_s: float = 0.005
) -> None:
    """:func:`sigkill_when` ``run_dir/checkpoints/step_<step>`` exists."""
    sigkill_when(cmd, (run_dir / "checkpoints" / f"step_{step}").is_dir, run_dir, env, timeout_s, poll_s)


def sigkill_at_step(cmd: list[str], run_dir: Path, step: int, env: dict[str, str], timeout_s: float) -> None:
    """:func:`sigkill_when` ``run_dir/metrics.jsonl`` holds ``step`` lines (it is flushed each step)."""
    metrics = run_dir / "metrics.jsonl"

    def reached() -> bool:
        try:
            return metrics.read_bytes().count(b"\n") >= step
        except OSError:
            return False

    sigkill_when(cmd, reached, run_dir, env, timeout_s)
