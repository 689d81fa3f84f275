"""A ``--nproc`` job lives and dies as one: its workers die with a launcher killed by SIGKILL, a second job on the
same run dir is refused naming the holder, the stale lock is taken over, and no temp folder outlives a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crosstrain.checkpoint.manager import read_latest_pointer
from crosstrain.cli.main import main
from crosstrain.runlock import LOCK_FILE, RunDirBusyError, RunDirLock, pid_alive

OPTS = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "logging.tensorboard=false",
        "checkpoint.every=4", "parallel.dp_replicate=2", "backend=cpu", "model.import_path=slowgpt:build"]
STEPS = 24

SLOW_GPT = """
import os, time
from crosstrain.models.gpt import GPT, GPTConfig


class SlowGPT(GPT):
    \"\"\"A small GPT; with SLOW_GPT=1 each forward also sleeps, so a test can act while the job runs.\"\"\"

    def forward(self, tokens):
        if os.environ.get("SLOW_GPT"):
            time.sleep(0.25)
        return super().forward(tokens)


def build(section):
    return SlowGPT(GPTConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=64))
"""


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "slowgpt.py").write_text(SLOW_GPT)
    monkeypatch.syspath_prepend(str(tmp_path / "models"))
    return tmp_path / "models"


def _env(tmp: Path, models: Path, slow: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    tmp.mkdir(exist_ok=True)
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(models), env.get("PYTHONPATH")])))
    if slow:
        env["SLOW_GPT"] = "1"
    return env


def _launch(run_dir: Path, tmp: Path, models: Path, slow: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets([*OPTS, f"train.steps={STEPS}"]),
           "--run-dir", str(run_dir)]
    # a session of its own: the test kills the launcher alone, never its process group
    return subprocess.Popen(cmd, env=_env(tmp, models, slow), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _left_behind(tmp: Path) -> list[str]:
    """What a job left in its temp dir (torch's per-user compile cache is not the job's)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0)
            if ppid == pid:
                out.append(int(entry.name))
    return out


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the job ended (rc={proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_sigkilled_launcher_takes_its_workers_and_the_resumed_job_matches(tmp_path, capsys, models) -> None:
    ref = _launch(tmp_path / "ref", tmp_path / "tmp_ref", models)
    run_dir = tmp_path / "run"
    victim = _launch(run_dir, tmp_path / "tmp", models, slow=True)
    workers: list[int] = []
    try:
        workers = _wait_for(lambda: len(_children(victim.pid)) >= 2 and _children(victim.pid), 120, "2 workers",
                            victim)
        _wait_for(lambda: read_latest_pointer(run_dir / "checkpoints"), 180, "a checkpoint", victim)
        # a second job on the same run dir: one line naming the launcher that holds it, and nothing written
        before = sorted(p.name for p in run_dir.iterdir())
        assert main(["train", *_sets([*OPTS, "parallel.dp_replicate=1"]), "--run-dir", str(run_dir)]) == 6
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line == (f"crosstrain: error: run dir {run_dir} is in use by another job (pid {victim.pid}); wait for "
                        "it to end, stop it, or pass another --run-dir")
        assert sorted(p.name for p in run_dir.iterdir()) == before
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        t0 = time.monotonic()
        _wait_for(lambda: not any(pid_alive(w) for w in workers), 15, "the workers to exit")
        assert time.monotonic() - t0 < 15
        ref_out, _ = ref.communicate(timeout=300)
        assert ref.returncode == 0, ref_out[-3000:]
    finally:
        for p in (ref, victim):
            if p.poll() is None:
                p.kill()
                p.wait()
        for w in workers:  # only if the guards failed: never leave orphans behind a failing test
            if pid_alive(w):
                os.kill(w, signal.SIGKILL)
    assert (run_dir / LOCK_FILE).exists() and not (run_dir / "summary.json").exists()
    assert _left_behind(tmp_path / "tmp")  # SIGKILL left the launcher's log folder behind ...
    resumed = _launch(run_dir, tmp_path / "tmp", models)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert "resumed from" in out  # ... the stale lock was taken over, and the folder is gone with it
    assert _left_behind(tmp_path / "tmp") == _left_behind(tmp_path / "tmp_ref") == []
    assert not (run_dir / LOCK_FILE).exists()
    a, b = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "ref", run_dir))
    assert b["steps"] == STEPS and 0 < b["steps_this_run"] < STEPS
    assert b["params_sha256"] == a["params_sha256"]


def test_a_failed_job_leaves_no_temp_folder_and_no_empty_run_dir(tmp_path, models) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "train", "--nproc", "2",
                           *_sets([*OPTS, "model.import_path=no_such_module_12:build"]), "--run-dir", str(run_dir)],
                          env=_env(tmp_path / "tmp", models), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "crosstrain: error: worker rank" in proc.stderr
    assert _left_behind(tmp_path / "tmp") == []
    assert not run_dir.exists()


def test_lock_is_exclusive_and_a_dead_holders_lock_is_taken_over(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from crosstrain.runlock import RunDirLock; RunDirLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusyError, match=rf"in use by another job \(pid {holder.pid}\)"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(holder.pid)  # left behind by the kill
    with RunDirLock(tmp_path) as lock:
        assert lock.took_over == holder.pid
        assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert not (tmp_path / LOCK_FILE).exists()
