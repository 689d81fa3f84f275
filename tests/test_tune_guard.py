"""``crosstrain tune`` on a study that exists: a trial whose only evaluation is at its last step finishes COMPLETE
even where the pruner would stop it; continuing the study with another space or base config, a storage that
cannot work and ``--example`` with another action are each one line, exit 2, with nothing created or changed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from in_process import crosstrain_main  # noqa: E402
from one_line import one_line_error  # noqa: E402

# trial 0 is the base config (optim.lr 3e-3); the seeded random sampler then draws 1e-5 (test_tune_kill.py's SPACE),
# whose eval loss at the last step is above the median of the finished trials
from test_tune_kill import SPACE, TINY, _sets  # noqa: E402

SETS = [s for s in TINY if not s.startswith(("train.steps", "eval.every"))] + [
    "train.steps=4", "eval.every=4", "schedule.warmup_steps=0"]


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_last_step_is_complete_and_a_continued_study_must_match(tmp_path: Path, capsys) -> None:
    import optuna
    from optuna.trial import TrialState

    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(SPACE)
    cmd = [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", "2", "--out", str(out), "--json"]
    done = subprocess.run([*cmd, *_sets(SETS)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    study = optuna.load_study(study_name="space", storage=result["storage"])
    trials = study.get_trials()
    assert [t.params["optim.lr"] for t in trials] == [0.003, 1e-5]
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    # the pruner would have stopped trial 1 at step 4, its last step: it finished, so it is COMPLETE with its value
    assert list(trials[1].intermediate_values) == [4] and trials[1].value > trials[0].value
    assert optuna.pruners.MedianPruner(n_startup_trials=1).prune(study, trials[1])
    summary = json.loads((Path(trials[1].user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] == 4 and not summary["preempted"] and summary["eval_loss"] == trials[1].value

    other_space = tmp_path / "other" / "space.toml"  # the same study name, a wider range
    other_space.parent.mkdir()
    other_space.write_text(SPACE.replace("1e-5]", "1e-5, 1e-4]"))
    not_a_db = tmp_path / "notes.db"  # SQLite's header, then no database: SQLAlchemy's error has an [SQL: ...] line
    not_a_db.write_bytes(b"SQLite format 3\x00" + b"\x10\x00" + b"\x01" * 200)
    db_folder = tmp_path / "dbdir"
    (db_folder / "tune.db").mkdir(parents=True)
    new = tmp_path / "new"
    refusals = {  # argv -> words of the one line
        (*cmd, *_sets([*SETS, "optim.weight_decay=0.05"])): ["another base config", "optim.weight_decay",
                                                             "--study NEW_NAME"],
        (*cmd[:4], str(other_space), *cmd[5:], *_sets(SETS)): ["another search space", "optim.lr"],
        (*cmd[:-2], str(new), "--storage", "journal:/missing/dir/j.log", *_sets(SETS)): ["--storage", "/missing/dir"],
        (*cmd[:-2], str(new), "--storage", "foo://bar", *_sets(SETS)): ["--storage 'foo://bar'", "not a storage URL"],
        (*cmd[:-2], str(new), "--storage", f"sqlite:///{not_a_db}", *_sets(SETS)): ["file is not a database"],
        (*cmd[:-2], str(db_folder), *_sets(SETS)): ["the study database", "is a folder"],
        (sys.executable, "-m", "crosstrain", "tune", "--example", "--report", str(new)): ["--example", "--report"],
    }
    before = _snapshot(tmp_path)
    # the two storage cases as real processes (started together), the others in this process
    real = [argv for argv in refusals if "journal:/missing/dir/j.log" in argv or "foo://bar" in argv]
    procs = {argv: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in real}
    for argv in refusals:
        if argv in procs:
            got, err = procs[argv].communicate(timeout=300)
            code = procs[argv].returncode
        else:
            capsys.readouterr()
            code = crosstrain_main(list(argv[3:]))
            got, err = capsys.readouterr()
        assert code == 2, err
        line = one_line_error(got, err, lines=1)[0]
        for word in refusals[argv]:
            assert word in line, line
        assert "[SQL" not in line and "sqlalche.me" not in line, line
        if "--storage" not in argv:
            assert "--storage" not in line, line  # never blamed when it was not given
    assert not new.exists()
    assert _snapshot(tmp_path) == before  # the study, its run dirs and every other file as they were
