"""What a database server (PostgreSQL, MySQL) adds to a study that tuners on several machines share, each with its
own ``--out``: a study lock held on the server, and heartbeats of the running trials.

- **The lock.** Counting the trials and asking for (or taking over) one happen under ``<out>/.<study>.lock``, which
  only the tuners sharing that ``--out`` see; on a server they happen under a lock of the server as well
  (PostgreSQL's ``pg_advisory_lock``, MySQL's ``GET_LOCK``). It belongs to the server session, so the server drops
  it when a tuner dies, even by SIGKILL. Every tuner thus asks for trial k only after trial k-1 exists: exactly N
  trials, and trial k drawn by the sampler seeded for k whichever tuner asks for it.
- **Heartbeats.** Optuna's RDBStorage with ``heartbeat_interval`` keeps one heartbeat per running trial (the
  server's clock); a trial whose heartbeat is older than the grace period (twice the interval, Optuna's default) is
  stale (``_get_stale_trial_ids``, part of Optuna's ``BaseHeartbeat`` interface that every heartbeat storage
  implements). The tuner running a trial records one every interval, from when it is asked until it is told.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from crosstrain.errors import CrosstrainError

#: dialects with a lock of the server session: (take it, waiting; give it back). MariaDB refuses GET_LOCK's negative
#: "wait forever" (NULL, MDEV-4017), so the wait is a year
LOCKS = {
    "postgresql": ("SELECT pg_advisory_lock(:key)", "SELECT pg_advisory_unlock(:key)"),
    "mysql": ("SELECT GET_LOCK(:name, 31536000)", "SELECT RELEASE_LOCK(:name)"),
}


def is_server(url: str) -> bool:
    """Whether ``url`` names a PostgreSQL or MySQL server (the dialects with a server lock here)."""
    if url.startswith("journal:"):
        return False
    import sqlalchemy

    return sqlalchemy.engine.make_url(url).get_backend_name() in LOCKS


def beats(storage: Any) -> bool:
    """Whether ``storage`` records heartbeats (a server storage opened by a tuner): Optuna's heartbeat interface
    with an interval."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return interval is not None and interval() is not None


def on_server(storage: Any) -> bool:
    """Whether ``storage`` is an RDBStorage on a PostgreSQL or MySQL server."""
    engine = getattr(storage, "engine", None)
    return engine is not None and engine.dialect.name in LOCKS


@contextmanager
def server_lock(engine: Any, name: str) -> Iterator[None]:
    """The server's lock called ``name``, held for the block on a connection of its own."""
    from sqlalchemy import text

    lock, unlock = LOCKS[engine.dialect.name]
    digest = hashlib.sha256(f"crosstrain tune {name}".encode()).digest()
    # pg_advisory_lock takes a signed 64-bit key; MySQL lock names are at most 64 characters
    args = {"key": int.from_bytes(digest[:8], "big", signed=True), "name": "crosstrain-tune-" + digest.hex()[:40]}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        got = conn.execute(text(lock), args).scalar()
        if got == 0 or (got is None and engine.dialect.name == "mysql"):  # pg_advisory_lock returns nothing
            raise CrosstrainError(f"the database server did not give crosstrain tune its lock {name!r} "
                                  f"({lock.split()[1]} returned {got}); check the server's log")
        try:
            yield
        finally:
            conn.execute(text(unlock), args)


def study_server_lock(storage: Any, study: str) -> AbstractContextManager[None]:
    """The study's lock on the server for a storage on one, else nothing to hold."""
    return server_lock(storage.engine, "study " + study) if on_server(storage) else nullcontext()


def stale_trials(storage: Any, study: str) -> set[int]:
    """Ids of the study's RUNNING trials whose last heartbeat is older than the grace period (never beaten: not
    stale)."""
    return set(storage._get_stale_trial_ids(storage.get_study_id_from_name(study)))


class Heartbeat:
    """Records trial ``trial_id``'s heartbeat now and then every heartbeat interval until :meth:`stop`."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self._storage, self._trial_id = storage, trial_id
        self._stopped = threading.Event()
        storage.record_heartbeat(trial_id)
        self._thread = threading.Thread(target=self._beat, name=f"tune-heartbeat-{trial_id}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._storage.get_heartbeat_interval()):
            try:
                self._storage.record_heartbeat(self._trial_id)
            except Exception:  # a server hiccup: the next beat tries again; a long outage makes the trial stale
                continue

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
