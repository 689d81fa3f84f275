"""`crosstrain train --preempted-exit-code N`: a run that a signal stopped early saves its checkpoint and exits N, not
0, so a scheduler that replaces failed pods (crosstrain k8s's Jobs, with N = 143) replaces it and it resumes. The
case that matters on a cluster: one rank's node is preempted, the others stop by the vote after the same step,
and every launcher must exit N, not 0 (a 0 would mark the pod's index complete and the run unfinished)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from in_process import crosstrain_main

TINY = ["train.steps=100000", "train.batch_size=4", "train.seq_len=32", "eval.every=0", "logging.progress=none",
        "logging.tensorboard=false", "model.n_layers=1", "backend=cpu", "logging.every=1"]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _wait_for_steps(metrics: Path, n: int, alive=lambda: True, timeout: float = 120, quiet: bool = False) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and alive():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    if not quiet:
        raise AssertionError(f"{metrics} did not reach {n} steps")


def _worker_of_rank(launcher: int, rank: int) -> int:
    """The launcher's child process whose environment says RANK=rank (torchrun starts the workers itself)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def test_a_rank_signalled_alone_stops_every_rank_and_the_launcher_exits_n(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets([*TINY, "parallel.dp_replicate=2"]),
           "--run-dir", str(run_dir), "--preempted-exit-code", "143"]
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run_dir / "metrics.jsonl", 3, alive=lambda: proc.poll() is None)
        os.kill(_worker_of_rank(proc.pid, 1), signal.SIGTERM)  # as if rank 1's node were preempted
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "the workers stopped after a signal (here or on another node), saved a checkpoint" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["world_size"] == 2
    assert (run_dir / "checkpoints" / f"step_{summary['steps']}").is_dir()


def test_one_process_exits_n_after_sigterm_and_0_when_it_finishes(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", *_sets(TINY), "--run-dir", str(run_dir), "--preempted-exit-code", "75"]
    done = threading.Event()

    def signal_after_3_steps() -> None:
        # the trainer's SIGTERM handler is installed before its first step is written; signal only while it runs
        # (a run that failed early has returned, and the signal would end pytest), and at the deadline regardless
        _wait_for_steps(run_dir / "metrics.jsonl", 3, alive=lambda: not done.is_set(), timeout=120, quiet=True)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    signaller = threading.Thread(target=signal_after_3_steps)
    signaller.start()
    try:
        code = crosstrain_main(argv)
    finally:
        done.set()
        signaller.join()
    assert code == 75, capsys.readouterr().err[-2000:]
    stopped = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert (run_dir / "checkpoints" / f"step_{stopped}").is_dir()
    # resumed to its end, the same command exits 0
    assert crosstrain_main([*argv, "--set", f"train.steps={stopped + 1}"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["preempted"] is False


def test_an_exit_code_out_of_range_is_one_line_exit_2(tmp_path, capsys) -> None:
    runs = tmp_path / "runs"
    assert crosstrain_main(["train", "--preempted-exit-code", "256", "--set", f"train.output_dir={runs}"]) == 2
    assert "--preempted-exit-code=256 must be an exit status, 0 to 255" in capsys.readouterr().err
    assert not runs.exists()
