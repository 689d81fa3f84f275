"""Several tuners opening one new SQLite study database at the same moment all get it (the first creates the tables
under a file lock; without it two processes both create them and one fails with "table studies already exists")."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

pytest.importorskip("optuna")


def _open(url: str, barrier: mp.synchronize.Barrier, results: mp.Queue) -> None:
    from crosstrain.plugins.tune.study import open_storage

    barrier.wait()
    try:
        storage = open_storage(url)
        results.put(("ok", type(storage).__name__))
    except Exception as exc:  # reported to the test, which names it
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_concurrent_openers_of_a_new_sqlite_database_all_succeed(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    for attempt in range(3):
        url = f"sqlite:///{tmp_path / f'tune{attempt}.db'}"
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open, args=(url, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert all(kind == "ok" for kind, _ in got), got
