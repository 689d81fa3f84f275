"""`crosstrain slurm` against a real Slurm (tests/slurm_cluster.py starts one on this host, once per session):

- bad input: one line, exit 2, nothing written (sbatch's own refusal too);
- `--submit` of 2 tasks (1 node x 2 tasks; 2 nodes x 1 task) ends with the params_sha256 of `crosstrain train
  --nproc 2` run here;
- the time-limit signal (USR1 to the batch shell, what `--signal=B:USR1@S` makes Slurm send): the tasks save,
  the job requeues itself and resumes to the uninterrupted params_sha256;
- `scancel --signal=TERM` ends the job with a checkpoint; `scontrol requeue` resumes it to the same params_sha256.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster

from crosstrain.cli.main import main
from crosstrain.collective import free_port

# 300 steps of a few ms each: long enough that a signal sent after step 3 lands mid-run, short for CI
OPTS = ["train.steps=300", "train.batch_size=4", "train.seq_len=32", "parallel.dp_replicate=2", "backend=cpu",
        "eval.every=0", "checkpoint.every=0", "logging.progress=none", "logging.tensorboard=false"]
TIMEOUT = 240


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = slurm_cluster.missing()
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install slurm-wlm munge")
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"), _env())
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``crosstrain train --nproc 2`` of OPTS, started at once (it runs beside the first job); call for its
    summary."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.Popen([sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets(OPTS),
                             "--run-dir", str(run_dir)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def summary() -> dict:
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, out[-3000:]
        return _summary(run_dir)

    yield summary
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _submit(slurm, folder: Path, *args: str) -> tuple[str, Path, Path]:
    """``crosstrain slurm OPTS ARGS --submit`` from ``folder``; the job id, its run dir and its log."""
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "slurm", *_sets([*OPTS, f"train.output_dir={folder}"]),
                           "--port", str(free_port()), *args, "--submit"], cwd=folder, env=slurm.env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_id = re.search(r"submitted batch job (\d+)", proc.stdout).group(1)
    return job_id, folder / f"slurm-{job_id}", folder / f"slurm-{job_id}.out"


def _steps_done(slurm, job_id: str, run_dir: Path, log: Path, steps: int) -> None:
    """Wait until the job's run has recorded ``steps`` steps."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if slurm.job(job_id)["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"):
            break
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not reach step {steps}: {slurm.job(job_id)}\n{_read(log)}")


def _read(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else f"({path} was not written)"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nodes", "0"], "--nodes=0 must be >= 1"),
        (["--ntasks-per-node", "0"], "--ntasks-per-node=0 must be >= 1"),
        (["--time", "1:xx"], "--time='1:xx' is not a Slurm time limit"),
        (["--time", "2", "--signal-before", "120"], "--signal-before=120 s is not before the end of --time=2"),
        (["--ntasks-per-node", "2", "--set", "parallel.dp_replicate=4"], "does not divide the world size 2"),
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["--sbatch-arg=--time=5"], "must be one sbatch option such as --account=NAME that crosstrain does not set"),
        (["--job-name", "a b"], "--job-name='a b' must be letters, digits"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, needle) -> None:
    out = tmp_path / "runs"
    code = main(["slurm", "--set", f"train.output_dir={out}", *args, "--script", str(tmp_path / "s" / "x.sbatch")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("crosstrain: error: ") and needle in err[0], err
    assert not out.exists() and not (tmp_path / "s").exists()


def test_submit_without_sbatch_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a host without Slurm's clients
    out = tmp_path / "runs"
    assert main(["slurm", "--set", f"train.output_dir={out}", "--submit"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert not out.exists()


def test_job_sbatch_refuses_exits_2_and_leaves_nothing(slurm, tmp_path) -> None:
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "slurm", "--set", f"train.output_dir={out}",
                           "--partition", "nosuch", "--submit"], env=slurm.env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "sbatch refused the job" in err[0] and "partition" in err[0].lower(), err
    assert not out.exists()


def test_two_tasks_on_one_node_match_nproc_2(slurm, reference, tmp_path) -> None:
    job_id, run_dir, log = _submit(slurm, tmp_path, "--nodes", "1", "--ntasks-per-node", "2")
    info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT)
    assert info["NumNodes"] == "1" and info["NumTasks"] == "2", info
    summary, ref = _summary(run_dir), reference()
    assert summary["world_size"] == 2 and summary["steps"] == 300 and not summary["preempted"]
    assert summary["params_sha256"] == ref["params_sha256"], _read(log)


def test_two_nodes_one_task_each_match_nproc_2(slurm, reference, tmp_path) -> None:
    if len(slurm.nodes) < 2:
        pytest.skip(f"only {slurm.nodes} of {slurm_cluster.NODES} came up: this slurmd cannot run twice on a host")
    job_id, run_dir, log = _submit(slurm, tmp_path, "--nodes", "2", "--ntasks-per-node", "1")
    info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT)
    assert info["NodeList"] == "n[1-2]", info  # one task on each node daemon
    summary = _summary(run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 300
    assert summary["params_sha256"] == reference()["params_sha256"], _read(log)


def test_time_limit_signal_saves_requeues_and_resumes_exactly(slurm, reference, tmp_path) -> None:
    job_id, run_dir, log = _submit(slurm, tmp_path, "--nodes", "1", "--ntasks-per-node", "2", "--time", "30",
                                   "--signal-before", "60")
    _steps_done(slurm, job_id, run_dir, log, 3)
    # what Slurm sends at `--signal=B:USR1@60` (60 s before the limit), sent now
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)
    info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT, restarts=1)
    text = log.read_text()
    assert info["Restarts"] == "1" and "requeueing" in text, text[-3000:]
    stopped = int(re.search(r"SIGTERM received; finished step (\d+)", text).group(1))
    assert 3 <= stopped < 300 and f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'}" in text
    summary = _summary(run_dir)
    assert summary["steps"] == 300 and summary["steps_this_run"] == 300 - stopped
    assert summary["params_sha256"] == reference()["params_sha256"]


def test_scancel_term_saves_then_scontrol_requeue_resumes_exactly(slurm, reference, tmp_path) -> None:
    job_id, run_dir, log = _submit(slurm, tmp_path, "--nodes", "1", "--ntasks-per-node", "2")
    _steps_done(slurm, job_id, run_dir, log, 3)
    slurm.run("scancel", "--signal=TERM", job_id)
    slurm.wait(job_id, ("COMPLETED",), TIMEOUT)  # the tasks saved and exited 0: the job ended, not requeued
    stopped = _summary(run_dir)
    assert stopped["preempted"] is True and 3 <= stopped["steps"] < 300, _read(log)
    assert (run_dir / "checkpoints" / f"step_{stopped['steps']}").is_dir()
    slurm.run("scontrol", "requeue", job_id)
    info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT, restarts=1)
    assert info["Restarts"] == "1"
    summary = _summary(run_dir)
    assert summary["steps"] == 300 and summary["steps_this_run"] == 300 - stopped["steps"]
    assert summary["params_sha256"] == reference()["params_sha256"], _read(log)
