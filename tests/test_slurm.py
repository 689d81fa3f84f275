"""`crosstrain slurm` against a real Slurm (tests/slurm_cluster.py starts one on this host, once per session):

- bad input: one line, exit 2, nothing written (sbatch's own refusal too);
- `--submit` of 2 tasks (1 node x 2 tasks; 2 nodes x 1 task) ends with the params_sha256 of `crosstrain train
  --nproc 2` run here;
- the time-limit signal (USR1 to the batch shell, what `--signal=B:USR1@S` makes Slurm send): the tasks save,
  the job requeues itself and resumes to the uninterrupted params_sha256;
- `scancel --signal=TERM` ends the job with a checkpoint; `scontrol requeue` resumes it to the same params_sha256.
"""

from __future__ import annotations

import contextlib
import io
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

# 120 steps of a few ms each: long enough that a signal sent after step 3 lands mid-run, short for CI
OPTS = ["train.steps=120", "train.batch_size=4", "train.seq_len=32", "parallel.dp_replicate=2", "backend=cpu",
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
        if proc.returncode is None:
            out, _ = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, out[-3000:]
        assert proc.returncode == 0, "the reference run failed (see the first test that used it)"
        return _summary(run_dir)

    yield summary
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _submit(slurm, folder: Path, *args: str) -> tuple[str, Path, Path]:
    """``crosstrain slurm OPTS ARGS --submit`` run from ``folder`` (in this process: no second torch import), with
    the environment the job inherits through sbatch; the job id, its run dir and its log."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        for key in set(os.environ) - set(slurm.env):
            mp.delenv(key)
        for key, value in slurm.env.items():
            mp.setenv(key, value)
        mp.chdir(folder)
        code = main(["slurm", *_sets([*OPTS, f"train.output_dir={folder}"]), "--port", str(slurm.job_port()), *args,
                     "--submit"])
    assert code == 0, out.getvalue()
    job_id = re.search(r"submitted batch job (\d+)", out.getvalue()).group(1)
    return job_id, folder / f"slurm-{job_id}", folder / f"slurm-{job_id}.out"


def _signal_at_step(slurm, jobs: dict[str, tuple[str, Path, Path]], step: int, signals: dict[str, list[str]]) -> None:
    """Send each job its signal (scancel arguments) as soon as its run has recorded ``step`` steps."""
    waiting = dict(jobs)
    deadline = time.monotonic() + TIMEOUT
    while waiting and time.monotonic() < deadline:
        for name, (job_id, run_dir, log) in list(waiting.items()):
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
                slurm.run("scancel", *signals[name], job_id)
                del waiting[name]
            elif slurm.job(job_id)["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"):
                raise AssertionError(f"job {job_id} ended before step {step}: {slurm.job(job_id)}\n{_read(log)}")
        time.sleep(0.05)
    assert not waiting, f"{sorted(waiting)} did not reach step {step} in {TIMEOUT} s"


def _read(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else f"({path} was not written)"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nodes", "0"], "--nodes=0 must be >= 1"),
        (["--ntasks-per-node", "0"], "--ntasks-per-node=0 must be >= 1"),
        (["--time", "1:xx"], "--time='1:xx' is not a Slurm time limit"),
        (["--time", "2", "--signal-before", "120"], "--signal-before=120 s leaves 0 s of --time=2 (120 s)"),
        (["--time", "1:30", "--signal-before", "30"], "leaves 60 s of --time=1:30 (90 s) and Slurm may signal up"),
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


def test_output_dir_with_a_space_exits_2_and_writes_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "my runs"
    assert main(["slurm", "--set", f"train.output_dir={out}"]) == 2
    assert "holds whitespace, which an #SBATCH line cannot carry" in capsys.readouterr().err
    assert not out.exists()


def test_submit_without_sbatch_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a host without Slurm's clients
    out = tmp_path / "runs"
    assert main(["slurm", "--set", f"train.output_dir={out}", "--submit"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert not out.exists()


def test_job_sbatch_refuses_exits_2_and_leaves_nothing(slurm, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    out = tmp_path / "runs"
    assert main(["slurm", "--set", f"train.output_dir={out}", "--partition", "nosuch", "--submit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sbatch refused the job" in err[0] and "partition" in err[0].lower(), err
    assert not out.exists()


def test_two_task_jobs_match_nproc_2(slurm, reference, tmp_path) -> None:
    """1 node x 2 tasks and 2 nodes x 1 task (one task on each node daemon), submitted together."""
    layouts = {"1x2": ("--nodes", "1", "--ntasks-per-node", "2")}
    if len(slurm.nodes) == 2:
        layouts["2x1"] = ("--nodes", "2", "--ntasks-per-node", "1")
    jobs = {}
    for name, args in layouts.items():
        (tmp_path / name).mkdir()
        jobs[name] = _submit(slurm, tmp_path / name, *args)
    ref = reference()
    for name, (job_id, run_dir, log) in jobs.items():
        info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT)
        assert info["NumTasks"] == "2" and info["NumNodes"] == name[0], info
        if name == "2x1":
            assert info["NodeList"] == "n[1-2]", info  # one task on each node daemon
        summary = _summary(run_dir)
        assert summary["world_size"] == 2 and summary["steps"] == 120 and not summary["preempted"], _read(log)
        assert summary["params_sha256"] == ref["params_sha256"], (name, _read(log))
    if len(slurm.nodes) < 2:
        pytest.skip(f"only {slurm.nodes} of {slurm_cluster.NODES} came up: 2 nodes x 1 task was not run (this "
                    "slurmd cannot run twice on one host)")


@pytest.fixture(scope="module")
def preempted(slurm, tmp_path_factory) -> dict[str, tuple[str, Path, Path, int]]:
    """Two 1 x 2 jobs stopped after step 3 or later, side by side: "limit" gets what Slurm sends at
    `--signal=B:USR1@60` (USR1 to the batch shell, sent now) and requeues itself; "scancel" gets `scancel
    --signal=TERM`, ends with a checkpoint and is requeued with `scontrol requeue`. Each: job id, run dir, log,
    the step it stopped at; both have then finished."""
    jobs = {}
    for name, args in {"limit": ("--time", "30", "--signal-before", "60"), "scancel": ()}.items():
        folder = tmp_path_factory.mktemp(name)
        jobs[name] = _submit(slurm, folder, "--nodes", "1", "--ntasks-per-node", "2", *args)
    _signal_at_step(slurm, jobs, 3, {"limit": ["--batch", "--signal=USR1"], "scancel": ["--signal=TERM"]})
    job_id, run_dir, log = jobs["scancel"]
    info = slurm.wait(job_id, ("COMPLETED",), TIMEOUT)  # the tasks saved and exited 0: the job ended
    stopped = _summary(run_dir)
    assert info["Restarts"] == "0" and stopped["preempted"] is True, _read(log)
    assert (run_dir / "checkpoints" / f"step_{stopped['steps']}").is_dir()
    slurm.run("scontrol", "requeue", job_id)
    out = {}
    for name, (job_id, run_dir, log) in jobs.items():
        slurm.wait(job_id, ("COMPLETED",), TIMEOUT, restarts=1)
        found = re.search(r"SIGTERM received; finished step (\d+)", log.read_text())
        assert found, _read(log)
        out[name] = (job_id, run_dir, log, int(found.group(1)))
    return out


@pytest.mark.parametrize("path", ["limit", "scancel"])
def test_preempted_job_requeued_resumes_exactly(preempted, reference, path) -> None:
    """The time-limit signal (the job requeues itself) and `scancel --signal=TERM` + `scontrol requeue`: the run
    stopped mid-way with a checkpoint and ended with the uninterrupted params_sha256."""
    job_id, run_dir, log, stopped = preempted[path]
    text = log.read_text()
    assert 3 <= stopped < 120, text[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'} at step {stopped}" in text
    assert ("requeueing" in text) == (path == "limit")
    summary = _summary(run_dir)
    assert summary["steps"] == 120 and summary["steps_this_run"] == 120 - stopped and not summary["preempted"]
    assert summary["params_sha256"] == reference()["params_sha256"]
