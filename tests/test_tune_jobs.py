"""Many workers on one study: two ``crosstrain tune --jobs 2`` processes started together on one SQLite file
(PostgreSQL/MySQL were not available here) run exactly N trials between them (3 trials, 4 workers), each once,
in its own run dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from test_tune_kill import SIX as SPACE  # noqa: E402
from test_tune_kill import TINY, _sets  # noqa: E402


def test_two_tuners_with_two_jobs_each_share_one_sqlite_study(tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SPACE)
    sets = _sets([s for s in TINY if not s.startswith("train.steps")] + ["train.steps=4"])
    cmd = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "3", "--jobs", "2", "--out", str(out),
           "--json", *sets]
    tuners = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [t.communicate(timeout=600) for t in tuners]
    for t, (_, err) in zip(tuners, outputs, strict=True):
        assert t.returncode == 0, err
    started = [line for _, err in outputs for line in err.splitlines() if "starting trial" in line]
    assert sorted(int(line.split()[4]) for line in started) == [0, 1, 2]  # each trial run once, by one of 4 workers
    # a tuner reports the study as it is when its workers find nothing left; the later one sees all three
    assert max(json.loads(o.strip().splitlines()[-1])["complete"] for o, _ in outputs) == 3
    study = optuna.load_study(study_name="space", storage=f"sqlite:///{out.resolve() / 'tune.db'}")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state == TrialState.COMPLETE for t in trials)
    run_dirs = {t.user_attrs["run_dir"] for t in trials}
    assert len(run_dirs) == 3
    for run_dir, t in ((Path(t.user_attrs["run_dir"]), t) for t in trials):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["eval_loss"] == pytest.approx(t.value, abs=0)
        assert summary["params_sha256"]
