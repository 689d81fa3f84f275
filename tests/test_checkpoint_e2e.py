"""End-to-end recovery with the real trainer and real kill signals.

- A run killed with SIGKILL and started again (``checkpoint.resume=auto``) ends with the same ``params_sha256``
  as an uninterrupted run of the same length (CPU, same layout).
- ``torchrun --nproc-per-node 2 --max-restarts 2 -m crosstrain train``: SIGKILL one worker mid-training; the job
  restarts, resumes and finishes by itself with the uninterrupted 2-rank run's ``params_sha256``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import crosstrain_main

from crosstrain.checkpoint.manager import read_latest_pointer

COMMON = ["--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "logging.progress=none",
          "--set", "logging.tensorboard=false", "--set", "checkpoint.every=5", "--set", "checkpoint.keep_last=2"]
TIMEOUT = 240


def _cmd(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "crosstrain", "train", *COMMON, "--set", f"train.steps={steps}",
            "--run-dir", str(run_dir), *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # one thread, as the in-process runs use
    return env


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _wait_for_checkpoint(proc: subprocess.Popen, folder: Path, min_step: int) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        pointer = read_latest_pointer(folder)
        if pointer and int(pointer.split("_")[1]) >= min_step:
            return int(pointer.split("_")[1])
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"training ended (rc={proc.returncode}) before checkpoint {min_step}:\n{out}")
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint >= {min_step} within {TIMEOUT}s")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    return out


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = 40
    extra = ("--set", "checkpoint.async=true")
    victim_dir = tmp_path / "victim"
    victim = subprocess.Popen(_cmd(victim_dir, steps, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_env())
    try:
        _wait_for_checkpoint(victim, victim_dir / "checkpoints", 10)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        assert not (victim_dir / "summary.json").exists()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    # the uninterrupted reference and the resumed run need no process of their own
    assert crosstrain_main(_cmd(tmp_path / "ref", steps, *extra)[3:]) == 0
    capsys.readouterr()
    assert crosstrain_main(_cmd(victim_dir, steps, *extra)[3:]) == 0
    assert "resumed from" in capsys.readouterr().err
    a, b = _summary(tmp_path / "ref"), _summary(victim_dir)
    assert b["steps"] == steps and 0 < b["steps_this_run"] < steps
    assert b["params_sha256"] == a["params_sha256"]
    # metrics of the steps rolled back by the resume were dropped: every step once, losses as uninterrupted
    records = [json.loads(line) for line in (victim_dir / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank among the launcher's descendants."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            if ppid != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration, ValueError):
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker")
def test_elastic_restart_after_killing_one_rank(tmp_path: Path) -> None:
    steps = 30
    # the uninterrupted reference runs alongside (both spend most of their wall time starting and stopping), under
    # crosstrain's own launcher; the victim runs under the real torchrun CLI (the in-process launcher's restart
    # path is tested in test_cli_train.py)
    ref = subprocess.Popen(_cmd(tmp_path / "ref", steps, "--set", "parallel.dp_shard=2", "--nproc", "2"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    run_dir = tmp_path / "victim"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "2", "-m", "crosstrain"]
    victim = _cmd(run_dir, steps, "--set", "parallel.dp_shard=2")
    launcher = subprocess.Popen([*torchrun, *victim[victim.index("train"):]], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        _wait_for_checkpoint(launcher, run_dir / "checkpoints", 10)
        pid = _worker_pid(launcher.pid, 1)
        assert pid is not None, "could not find rank 1's process"
        os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=TIMEOUT)
        ref_out, _ = ref.communicate(timeout=TIMEOUT)
    finally:
        for p in (ref, launcher):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ref.returncode == 0, ref_out
    assert launcher.returncode == 0, out
    assert "local_rank: 1" in out and "exitcode: -9" in out, "rank 1 was not the one killed"
    summary = _summary(run_dir)
    assert summary["steps"] == steps and summary["steps_this_run"] < steps, "the job did not resume"
    assert summary["params_sha256"] == _summary(tmp_path / "ref")["params_sha256"]


def test_pipeline_parallel_run_resumes_exactly(tmp_path):
    """Each pipeline stage holds different modules: a pp=2 checkpoint restores every stage's own state (a new run
    resumed from the straight run's step-5 checkpoint ends with its params_sha256)."""
    layout = ["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.dp_shard=1"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(_cmd(straight, 10, *layout))
    step_5 = straight / "checkpoints" / "step_5"
    out = _run(_cmd(resumed, 10, *layout, "--set", f"checkpoint.resume={step_5}"))
    assert f"resumed from {step_5}" in out.stdout + out.stderr
    summary = _summary(resumed)
    assert summary["steps"] == 10 and summary["steps_this_run"] == 5
    assert summary["params_sha256"] == _summary(straight)["params_sha256"]
