"""``crosstrain tune --storage postgresql://...`` on a real PostgreSQL server (tests/postgres_server.py: Debian's
package, one cluster per session, password authentication over TCP).

Three tuners, each with its own ``--out`` as on three machines, share one study of 9 trials; one is killed with
SIGKILL during a trial. The others take that trial over once its heartbeat is stale and resume it from its
checkpoint; the study ends with trials 0-8, each run once, and equals a single tuner's study of the same seed trial
for trial (the random sampler seeded with ``seed + k`` for trial k, asked under the server's lock). A dead tuner's
trial whose run dir is on no machine here starts again from step 0, and only once its heartbeat is stale. A bad
server URL, a wrong password and a missing driver are one line, exit 2, nothing created.

The first two tests also run on MariaDB (``mysql+pymysql://``, tests/mysql_server.py) where its server is installed;
``.ci/run`` does not install it, so CI skips those cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("optuna")
pytest.importorskip("psycopg")

from in_process import crosstrain_main  # noqa: E402
from mysql_server import mariadb  # noqa: E402, F401  (the session fixtures)
from one_line import one_line_error  # noqa: E402
from postgres_server import Server, postgres  # noqa: E402, F401
from test_tune_kill import TINY, _processes_mentioning, _sets  # noqa: E402

# the random sampler draws trial k with seed + k and reads no history, so which tuner asks for trial k does not
# change its parameters; no pruner, whose decisions would depend on how far the other trials have got
SPACE = """[tune]
pruner = "none"
sampler = "random"
seed = 0
heartbeat = 1
[space]
"optim.lr" = { low = 1e-3, high = 3e-3, log = true }
"""
# 20 steps with a checkpoint every 2: the kill after a trial's first checkpoint lands with 18 steps to go
SETS = _sets([s for s in TINY if not s.startswith(("train.steps", "eval.every"))] + [
    "train.steps=20", "eval.every=20", "checkpoint.every=2"])


@pytest.fixture
def pgpass(postgres: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """As a deployment keeps it: the password in a ``.pgpass`` file (libpq's ``PGPASSFILE``) for this process and
    the tuners it starts, not in the URL, which every trial gets on its command line and in its config.toml."""
    path = tmp_path / "pgpass"
    path.write_text(f"{postgres.host}:{postgres.port}:tune:crosstrain:{postgres.password}\n")
    path.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(path))


def _url(server: Server) -> str:
    return f"postgresql://crosstrain@{server.host}:{server.port}/tune"


@pytest.fixture(params=["postgresql", "mysql"])
def server_url(request: pytest.FixtureRequest) -> str:
    """A storage URL on each server: PostgreSQL (its password in ``.pgpass``) and MariaDB (where installed)."""
    if request.param == "postgresql":
        request.getfixturevalue("pgpass")
        return _url(request.getfixturevalue("postgres"))
    pytest.importorskip("pymysql")
    return request.getfixturevalue("mariadb").url()


def _tune(space: Path, out: Path, url: str, study: str, trials: int) -> list[str]:
    return [sys.executable, "-m", "crosstrain", "tune", str(space), "--trials", str(trials), "--out", str(out),
            "--storage", url, "--study", study, "--json", *SETS]


def _lines(text: str, what: str) -> list[int]:
    """Trial numbers of the tuner's ``crosstrain tune: <what> trial N ...`` lines."""
    return [int(line.split()[4]) for line in text.splitlines() if line.startswith(f"crosstrain tune: {what} trial")]


def test_three_tuners_nine_trials_one_killed_and_resumed(server_url: str, tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    from crosstrain.plugins.tune.storage import shown_url

    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    url = server_url
    outs = [tmp_path / f"machine_{m}" for m in "abc"]
    logs = [tmp_path / f"tuner_{m}.log" for m in "abc"]
    tuners = []
    for out, log in zip(outs, logs, strict=True):
        with open(log, "w") as err:
            tuners.append(subprocess.Popen(_tune(space, out, url, "three", 9), stdout=subprocess.PIPE, stderr=err,
                                           text=True, start_new_session=True))
    # the single tuner of the same seed (its own study), at the same time: the cores are shared
    single = subprocess.Popen(_tune(space, tmp_path / "single", url, "single", 9), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        first: list[Path] = []
        while not first and tuners[0].poll() is None and time.time() < deadline:
            first = list((outs[0] / "three").glob("trial_*/checkpoints/step_2"))
            time.sleep(0.005)
        machine_a = set(_processes_mentioning(str(outs[0])))  # its tuner and its trial
        os.kill(tuners[0].pid, signal.SIGKILL)  # machine a's tuner, during its first trial
        tuners[0].wait(timeout=60)
        assert first, "machine a's tuner ran no trial"
        assert len(machine_a) >= 2, machine_a
        killed = first[0].parent.parent
        assert not (killed / "summary.json").exists(), f"{killed.name} finished before its tuner could be killed"
        deadline = time.time() + 30
        # (another tuner resuming the trial later runs it in machine a's run dir too: its processes do not count)
        while machine_a & set(_processes_mentioning(str(outs[0]))) and time.time() < deadline:
            time.sleep(0.1)
        assert machine_a & set(_processes_mentioning(str(outs[0]))) == set()  # its trial died with it

        results = []
        for tuner in tuners[1:]:
            out, _ = tuner.communicate(timeout=900)
            assert tuner.returncode == 0, Path(logs[tuners.index(tuner)]).read_text()
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert [r["storage"] for r in results] == [shown_url(url)] * 2
        err = [log.read_text() for log in logs]
        number = int(killed.name.split("_")[1])
        started = sorted(n for text in err for n in _lines(text, "starting"))
        assert started == list(range(9))  # each trial started once, by one of the three tuners
        assert sorted(n for text in err[1:] for n in _lines(text, "resuming")) == [number]

        storage = optuna.storages.RDBStorage(url)
        trials = optuna.load_study(study_name="three", storage=storage).get_trials()
        assert [t.number for t in trials] == list(range(9)) and all(t.state == TrialState.COMPLETE for t in trials)
        assert len({t.params["optim.lr"] for t in trials}) == 9  # no parameter set twice
        assert len({t.user_attrs["run_dir"] for t in trials}) == 9
        assert trials[number].user_attrs["run_dir"] == str(killed.resolve())  # resumed where it ran
        events = [json.loads(line) for line in (killed / "events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "resume" and e["step"] >= 2 for e in events)
        for t in trials:
            summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
            assert summary["steps"] == 20 and summary["eval_loss"] == t.value

        _, single_err = single.communicate(timeout=900)
        assert single.returncode == 0, single_err
        reference = optuna.load_study(study_name="single", storage=storage).get_trials()
        assert [(t.number, t.params, t.value) for t in trials] == [(t.number, t.params, t.value) for t in reference]
        ran = json.loads((killed / "summary.json").read_text())
        uninterrupted = json.loads((Path(reference[number].user_attrs["run_dir"]) / "summary.json").read_text())
        assert ran["params_sha256"] == uninterrupted["params_sha256"]  # resumed: the weights of an unkilled run
    finally:  # a failed check leaves no tuner running (their trials die with them)
        for proc in [*tuners, single]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def open_study(space: Path, url: str) -> tuple:
    """What a tuner opens, with heartbeats every 3 s (stale after 6 s): the space's settings and params, the
    storage and the study ``elsewhere``."""
    from crosstrain.config import load_config
    from crosstrain.plugins.tune.record import describe
    from crosstrain.plugins.tune.space import read_space
    from crosstrain.plugins.tune.study import load_study, open_storage

    settings, params, _ = read_space(str(space))
    storage = open_storage(url, heartbeat=3)
    return settings, params, storage, load_study("elsewhere", storage, settings, params, 20, 20,
                                                 describe(settings, params, load_config()))


def test_a_dead_tuners_trial_elsewhere_restarts_here_once_its_heartbeat_is_stale(server_url: str,
                                                                                 tmp_path: Path) -> None:
    """A tuner on another machine asks for trial 0, names its run dir there and dies (SIGKILL); the run dir is not
    on this machine. While its heartbeat is recent the trial is left to it (WAIT); once stale it starts here, with
    its parameters, from step 0. A trial asked by a process that died before naming any run dir starts at once."""
    import shutil

    from crosstrain.plugins.tune.study import WAIT, Taken, take_next

    space, url = tmp_path / "space.toml", server_url
    space.write_text(SPACE)
    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    settings, params, storage, study = open_study(space, url)  # first: the WAIT below follows the death at once
    dead = subprocess.run([sys.executable, "-c", f"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_tune_postgres import open_study
from crosstrain.plugins.tune.study import take_next
settings, params, storage, study = open_study(Path({str(space)!r}), {url!r})
take_next(study, storage, Path({str(elsewhere)!r}), 1, None, settings, params, local=False)
os.kill(os.getpid(), signal.SIGKILL)
"""], capture_output=True, text=True, timeout=300)
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    shutil.rmtree(elsewhere)  # that machine's disk: not here
    asked = study.get_trials()[0]
    assert Path(asked.user_attrs["run_dir"]).parent.parent == elsewhere.resolve()
    assert take_next(study, storage, here, 1, None, settings, params, local=False) == WAIT
    deadline = time.time() + 60
    taken = WAIT
    while taken == WAIT and time.time() < deadline:
        time.sleep(0.5)
        taken = take_next(study, storage, here, 1, None, settings, params, local=False)
    assert isinstance(taken, Taken) and taken.how == "restarting"
    assert (taken.trial.number, taken.params) == (0, asked.params)
    assert taken.trial.user_attrs["run_dir"] == str((here / "elsewhere" / "trial_0000").resolve())
    taken.release()

    orphan = subprocess.run([sys.executable, "-c", "import optuna, os, signal; optuna.load_study(study_name="
                             f"'elsewhere', storage={url!r}).ask(); os.kill(os.getpid(), signal.SIGKILL)"],
                            timeout=120)
    assert orphan.returncode == -signal.SIGKILL
    taken = take_next(study, storage, here, 2, None, settings, params, local=False)
    assert isinstance(taken, Taken) and (taken.trial.number, taken.how) == (1, "starting")
    taken.release()


def test_bad_server_urls_are_one_line_and_create_nothing(postgres: Server, tmp_path: Path,  # noqa: F811
                                                         capsys) -> None:
    space, new = tmp_path / "space.toml", tmp_path / "new"
    space.write_text(SPACE)
    wrong = f"postgresql://crosstrain:not-{postgres.password}@{postgres.host}:{postgres.port}/tune"
    closed = f"postgresql://crosstrain:{postgres.password}@{postgres.host}:1/tune"
    cases = {
        wrong: ["cannot be opened", "password authentication failed", "***"],
        closed: ["cannot be opened", "Connection refused"],
        _url(postgres).replace("postgresql:", "postgresql+pg8000:"): ["needs a database driver", "pg8000",
                                                                     "crosstrain[tune-postgres]"],
    }
    for url, words in cases.items():
        capsys.readouterr()
        code = crosstrain_main(["tune", str(space), "--out", str(new), "--storage", url, *SETS])
        out, err = capsys.readouterr()
        assert code == 2, err
        line = one_line_error(out, err, lines=1)[0]
        for word in words:
            assert word in line, line
        assert postgres.password not in line
    assert not new.exists()
    from crosstrain.plugins.tune.storage import shown_url  # what the --json line prints as "storage"

    assert shown_url(closed) == closed.replace(postgres.password, "***")
