"""Trials that fail because of their machine: which failures count as such (closed cases), and a real full disk
(a tmpfs in a user namespace) whose failed trial is retried, stops the search in one line once its retries are
spent, and is run again by the same command after the space is back, so the study ends complete rather than stuck
at "complete 0, failed 2"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from test_bad_inputs import _can_mount_tmpfs  # noqa: E402
from test_tune_kill import TINY, _sets  # noqa: E402

from crosstrain.fault.peer_loss import EXIT_PEER_LOST  # noqa: E402
from crosstrain.plugins.tune.retry import FULL_BELOW, environment_cause  # noqa: E402

SPACE = """[tune]
pruner = "none"
retries = 1
[space]
"optim.lr" = { low = 1e-3, high = 3e-3, log = true }
"""


@pytest.mark.parametrize(("code", "line", "free", "cause"), [
    (5, "crosstrain: error: no space left on device at run/checkpoints (needed about 1.90 MB, 0.00 MB free); ...",
     10 << 30, "no disk space"),
    (5, "crosstrain: error: a file-size limit (ulimit -f, 1.00 MB) stopped a checkpoint write at run ...", 10 << 30,
     "no disk space"),
    (1, "OSError: [Errno 28] No space left on device", 10 << 30, "no disk space"),
    (1, "OSError: [Errno 122] Disk quota exceeded", 10 << 30, "no disk space"),
    (1, "", FULL_BELOW - 1, "no disk space"),  # a full disk can leave the trial's own log empty
    (-signal.SIGKILL, "", 10 << 30, "killed by SIGKILL"),  # the OOM killer, a kill by hand
    (-signal.SIGTERM, "", None, "killed by SIGTERM"),
    (EXIT_PEER_LOST, "crosstrain: error: lost another rank (Connection reset by peer)", None, "a rank was lost"),
    (None, "PermissionError: [Errno 13] Permission denied: 'out/space/trial_0003'", 10 << 30, None),
    (2, "crosstrain: error: optim.lr=-1: must be > 0", 10 << 30, None),  # the config: the same again
    (1, "crosstrain: error: the loss is not finite at step 3", 10 << 30, None),
    (-signal.SIGSEGV, "", 10 << 30, None),  # a crash the same parameters repeat
    (0, "", None, None),
])
def test_environment_cause(code: int | None, line: str, free: int | None, cause: str | None) -> None:
    assert environment_cause(code, line, free) == cause


def test_full_disk_trials_are_retried_then_run_again_once_space_is_back(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    from crosstrain.plugins.tune.retry import CAUSE, RETRY_OF

    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("needs unshare and a tmpfs mount in a user namespace to make a small, really full disk")
    space, out, storage = tmp_path / "space.toml", disk / "out", f"sqlite:///{tmp_path / 'tune.db'}"
    space.write_text(SPACE)
    sets = _sets([s for s in TINY if not s.startswith(("train.steps", "eval.every"))] + ["train.steps=2",
                                                                                        "eval.every=2"])
    cmd = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "1", "--out", str(out), "--storage",
           storage, "--json", *sets]
    # the run dirs on a 64 KiB tmpfs filled to the last byte; the study outside it
    script = (f"mount -t tmpfs -o size=64k none {disk} && (head -c 1000000 /dev/zero >{disk}/fill 2>/dev/null;"
              f" {' '.join(cmd)} >{tmp_path}/out 2>{tmp_path}/err; echo $? >{tmp_path}/rc)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=600, env=env)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "crosstrain: error: trial 0's parameters failed 2 times from the machine (no disk space")
    assert "crosstrain tune: no disk space: trial 0's parameters queued again (try 2 of 2)" in err
    study = optuna.load_study(study_name="space", storage=storage)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING]
    assert [t.user_attrs.get(CAUSE) for t in trials[:2]] == ["no disk space"] * 2

    # the space is back (the tmpfs is gone with its namespace): the same command runs the queued parameters
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout.strip().splitlines()[-1])
    assert (result["complete"], result["failed"], result["retried"]) == (1, 0, 2)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[2].params == trials[1].params == trials[0].params == {"optim.lr": 3e-3}  # the base config
    assert trials[1].user_attrs[RETRY_OF] == trials[2].user_attrs[RETRY_OF] == 0
    summary = json.loads((Path(trials[2].user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_loss"] == trials[2].value
