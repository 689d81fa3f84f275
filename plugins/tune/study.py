"""The study: its storage (SQLite in ``--out`` by default), sampler and pruner, and the claim of a trial.

A trial belongs to the tuner that holds the ``flock`` on ``<trial run dir>/tune.claim``; the kernel drops it
when that tuner dies, even by SIGKILL. So a RUNNING trial whose claim is free was left by a dead tuner: the next
tuner takes it over and resumes its run dir (Optuna alone would leave it RUNNING forever). Asking for a new
trial and taking over an old one happen under ``<out>/<study>.lock``, so N trials are never exceeded by
concurrent tuners sharing ``--out``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.config import SearchSettings
from crosstrain.plugins.tune.server import Heartbeat
from crosstrain.plugins.tune.space import Param

CLAIM = "tune.claim"
#: trial user attr: ``host:out`` of the tuner that asked for the trial
TUNER = "tuner"
#: SQLite waits this long for a lock held by another worker (the tuner, a trial's rank 0, another tuner)
SQLITE_TIMEOUT_S = 120
#: a database server that does not answer a connection within this long is refused
SERVER_TIMEOUT_S = 10


def default_storage(out: Path) -> str:
    return f"sqlite:///{(out / 'tune.db').resolve()}"


def open_storage(url: str, given: bool = True, heartbeat: int | None = None) -> Any:
    """An Optuna storage: an RDB URL (``sqlite:///``, ``postgresql://``, ``mysql://``) or ``journal:PATH``
    (Optuna's JournalStorage on a file). ``given``: the URL came from ``--storage`` (errors name the flag);
    ``heartbeat``: on a database server, the seconds between a running trial's heartbeats (a tuner's storage)."""
    import optuna

    from crosstrain.plugins.tune.server import is_server
    from crosstrain.plugins.tune.storage import check_url, storage_error

    check_url(url, given)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
        except OSError as exc:
            raise storage_error(exc, url, given) from None
    kwargs: dict[str, Any] = {}
    beats: dict[str, Any] = {}
    lock: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    new_lock: Path | None = None
    if is_server(url):
        beats = {"heartbeat_interval": heartbeat} if heartbeat else {}
        # an unreachable host is refused in seconds, not after the TCP timeout (psycopg's and pymysql's argument)
        kwargs = {"connect_args": {"connect_timeout": SERVER_TIMEOUT_S}}
        lock = _tables_lock(url, kwargs)
    elif url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        path = url.split(":///", 1)[-1]
        if path and path != ":memory:":
            # two tuners opening a new database at once would both create its tables ("table studies already
            # exists"): the first to hold the lock creates them, the others find them
            lock_file = Path(path).with_name(Path(path).name + ".lock")
            new_lock = None if lock_file.exists() else lock_file  # removed again if the database cannot be opened
            lock = _file_lock(lock_file)
    try:
        with lock, warnings.catch_warnings():
            # Optuna marks heartbeat_interval experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **beats)
    except Exception as exc:  # a URL SQLAlchemy cannot open: a bad host, a password, not a database
        if new_lock is not None:
            new_lock.unlink(missing_ok=True)
        raise storage_error(exc, url, given) from None


@contextmanager
def _tables_lock(url: str, engine_kwargs: dict[str, Any]) -> Iterator[None]:
    """Held while a tuner opens a server storage: two tuners creating Optuna's tables at once on a new database
    collide in the server's catalog (PostgreSQL: duplicate key in ``pg_type``)."""
    import sqlalchemy

    from crosstrain.plugins.tune.server import server_lock

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        with server_lock(engine, "tables"):
            yield
    finally:
        engine.dispose()


def make_sampler(settings: SearchSettings, params: list[Param], offset: int = 0) -> Any:
    """The sampler that draws trial number ``offset``: seeded with ``seed + offset``, so a tuner started again (or
    a second tuner) does not replay the random stream of the first; the samplers keep no other state between
    trials (their history is the study's)."""
    import optuna

    seed = settings.seed + offset
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.sampler == "grid":
        return optuna.samplers.GridSampler({p.key: p.grid() for p in params}, seed=seed)
    if settings.sampler == "cmaes":
        import importlib.util

        if importlib.util.find_spec("cmaes") is None:
            raise ConfigError("sampler = 'cmaes' needs the cmaes package (not installed); run: pip install cmaes, "
                              "or use sampler = 'tpe'")
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(settings: Any, steps: int, eval_every: int) -> Any:
    """Median (Optuna's MedianPruner), Hyperband (Li et al. 2018) or ASHA (Li et al. 2020, successive halving)
    over the trial's eval steps; ``none`` never prunes. ``settings``: a space file's or a run's ``[tune]``
    (the tuner and each trial's rank 0 build the same pruner: Optuna does not store it with the study)."""
    import optuna

    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=settings.startup_trials,
                                           n_warmup_steps=settings.warmup_steps, interval_steps=1)
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=eval_every, max_resource=steps, reduction_factor=3)
    if settings.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_every, reduction_factor=3)
    return optuna.pruners.NopPruner()


def load_study(name: str, storage: Any, settings: SearchSettings, params: list[Param], steps: int,
               eval_every: int, record: dict[str, Any]) -> Any:
    """The study ``name``, created with ``record`` (:func:`crosstrain.plugins.tune.record.describe`) or continued
    when its direction, space and base config are those of this search (else one line, exit 2)."""
    import optuna

    from crosstrain.plugins.tune.record import check
    from crosstrain.plugins.tune.server import study_server_lock

    with study_server_lock(storage, name):  # tuners on several machines creating it at once record it once
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                    direction=settings.direction, sampler=make_sampler(settings, params),
                                    pruner=make_pruner(settings, steps, eval_every))
        if study.direction.name.lower() != settings.direction:
            raise ConfigError(f"study {name!r} in this storage was created with direction "
                              f"{study.direction.name.lower()}; pass another --study or the same direction")
        check(study, record)
    return study


@contextmanager
def study_lock(out: Path, name: str, storage: Any = None) -> Iterator[None]:
    """Held while a worker counts the trials and asks or claims one: by all tuners sharing ``--out`` and, with a
    ``storage`` on a database server, by all tuners of the study (crosstrain.plugins.tune.server)."""
    from crosstrain.plugins.tune.server import study_server_lock

    out.mkdir(parents=True, exist_ok=True)
    with _file_lock(out / f".{name}.lock"), study_server_lock(storage, name):
        yield


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


class Claim:
    """The ``flock`` on a trial's ``tune.claim``: held for as long as this tuner runs the trial."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / CLAIM, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:  # who holds it, for a person looking: the lock is the flock, so a full disk does not matter here
            os.ftruncate(fd, 0)
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        except OSError:
            pass
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def trial_dir(out: Path, name: str, number: int) -> Path:
    return out / name / f"trial_{number:04d}"


#: :func:`take_next`'s answer on a server when no trial can start but some still run: ask again in a while (a dead
#: tuner's trial is taken over once its heartbeat is stale, so the study never ends with a trial RUNNING)
WAIT = "wait"


@dataclass
class Taken:
    """A trial a worker runs: its parameters, the claim on its run dir and, on a server, its heartbeat. ``how``:
    ``starting``, ``resuming`` (from its run dir's last checkpoint) or ``restarting`` (its run dir is on another
    machine: run again here from step 0)."""

    trial: Any
    params: dict[str, Any]
    claim: Claim
    how: str
    heartbeat: Heartbeat | None = None

    def release(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.claim.release()


def take_next(study: Any, storage: Any, out: Path, limit: int, enqueue: dict[str, Any] | None,
              settings: SearchSettings, params: list[Param], local: bool) -> Taken | str | None:
    """Under the study lock: a RUNNING trial left by a dead tuner (its stored parameters), or a new one (a WAITING
    retry first, else drawn by a sampler seeded for its number) while fewer than ``limit`` of the study's slots are
    taken (:func:`crosstrain.plugins.tune.retry.slots_taken`); else :data:`WAIT` on a server while a trial still
    runs, None when nothing is left. ``local``: the storage is ``out``'s own database, so every trial in it was
    asked by a tuner on this ``out``.

    A RUNNING trial's tuner is dead when the ``flock`` on its run dir's claim is free; on a server, when its
    heartbeat is also stale (a live tuner whose claim this machine cannot see keeps its trial), or stale alone when
    its run dir is not on this machine (then it runs again here, from its start)."""
    from crosstrain.plugins.tune.server import beats

    server = beats(storage)
    with study_lock(out, study.study_name, storage):
        taken = _take(study, storage, out, limit, enqueue, settings, params, local, server)
        if isinstance(taken, Taken) and server:  # beating before the lock is released: never stale in between
            taken.heartbeat = Heartbeat(storage, taken.trial._trial_id)
        return taken


def _take(study: Any, storage: Any, out: Path, limit: int, enqueue: dict[str, Any] | None,
          settings: SearchSettings, params: list[Param], local: bool, server: bool) -> Taken | str | None:
    import optuna
    from optuna.trial import TrialState

    from crosstrain.plugins.tune.retry import slots_taken
    from crosstrain.plugins.tune.server import stale_trials

    here = f"{socket.gethostname()}:{out.resolve()}"
    trials = study.get_trials(deepcopy=False)
    stale = stale_trials(storage, study.study_name) if server else set()
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        run_dir = t.user_attrs.get("run_dir")
        if not run_dir and (local or server or t.user_attrs.get(TUNER) == here):
            # asked by a tuner that died before it named the run dir (no live one can be between the two: both
            # happen under the lock held here, this out's or the server's): start it now, with whatever parameters
            # it already has
            study.sampler = make_sampler(settings, params, offset=t.number)
            return _start(study, optuna.trial.Trial(study, t._trial_id), out, params)
        if server and t._trial_id not in stale:
            continue  # its tuner's heartbeats are recent: alive
        if not run_dir or not Path(run_dir).is_dir():
            if server:  # a dead tuner's trial whose run dir (its checkpoints) is on another machine
                return _start(study, optuna.trial.Trial(study, t._trial_id), out, params, how="restarting")
            continue  # another machine's trial (its run dir is not here) is left to that machine
        claim = Claim(Path(run_dir))
        if not claim.try_acquire():
            continue  # its tuner is alive
        # its tuner may have told the trial and released the claim since the read above: read it again
        if _state(study, t.number) == TrialState.RUNNING:
            return Taken(optuna.trial.Trial(study, t._trial_id), dict(t.params), claim, "resuming")
        claim.release()
    waiting = any(t.state == TrialState.WAITING for t in trials)
    if slots_taken(trials) >= limit and not waiting:  # a WAITING trial (a retry) already has its slot
        return WAIT if server and any(t.state == TrialState.RUNNING for t in trials) else None
    if enqueue is not None and not trials:
        study.enqueue_trial(enqueue, user_attrs={"base_config": True, TUNER: here})
    elif not waiting and not local and not server and settings.sampler != "grid":
        # tag the trial before it is RUNNING, so that a tuner on this out finds it if this one dies before
        # naming its run dir (the grid sampler draws nothing for an enqueued trial: not tagged, not found)
        study.enqueue_trial({}, user_attrs={TUNER: here})
    study.sampler = make_sampler(settings, params, offset=len(trials))
    with warnings.catch_warnings():  # Optuna warns that a heartbeat storage is meant for optimize(): ask is ours
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        trial = study.ask()
    return _start(study, trial, out, params)


def _start(study: Any, trial: Any, out: Path, params: list[Param], how: str = "starting") -> Taken:
    """Draw ``trial``'s parameters (an enqueued or already drawn one keeps its value), claim its run dir here and
    name it in the trial."""
    from optuna.trial import TrialState

    chosen = {p.key: p.suggest(trial) for p in params}
    run_dir = trial_dir(out, study.study_name, trial.number)
    claim = Claim(run_dir)
    if not claim.try_acquire():  # a run dir of the same name from an earlier study: refuse rather than mix
        study.tell(trial, state=TrialState.FAIL)
        raise ConfigError(f"{run_dir} is held by another process; pass another --out or --study")
    trial.set_user_attr("run_dir", str(run_dir.resolve()))
    return Taken(trial, chosen, claim, how)


def _state(study: Any, number: int) -> Any:
    """A trial's state as the storage has it now (unfinished trials are read again on every ``get_trials``)."""
    return next(t.state for t in study.get_trials(deepcopy=False) if t.number == number)
