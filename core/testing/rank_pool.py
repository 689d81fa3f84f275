"""Long-lived real gloo ranks: ``RankPool(n).run(fn, *args)`` is ``run_ranks(fn, n, *args)`` without the start-up
(n spawned interpreters importing torch and crosstrain and joining a process group, several seconds on 2 cores)
that each call of :func:`crosstrain.testing.multiprocess.run_ranks` pays.

The ranks start on first use and run one call at a time: ``fn(collective, *args)`` on every rank, results in rank
order, a rank's exception re-raised here with its traceback. After a failure or a timeout the ranks are killed
(one may be blocked in a collective its peer never joins) and the next call starts fresh ones. Each call gets the
settings run_ranks gives (one thread, the cpu backend active, or the pool's ``backend``, whose collective the
ranks' process group then is); what a call leaves behind in the process (meshes,
caches) is what a second Trainer in one process sees, as under the CLI's launcher. Ranks that have grown past
``max_rss_bytes`` after a call are replaced before the next, so memory stays bounded. A function that leaves the
process group unusable on purpose (a rank that never joins a collective) needs ranks of its own: run_ranks.
"""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

MAX_RSS_BYTES = 1 << 30


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any, backend: str = "cpu") -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        import torch

        from crosstrain import registry

        collective = registry.set_active_backend(backend).collective()
        collective.init(timeout=120)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, False, traceback.format_exc()))
        return
    while True:
        seq, fn, args = tasks.get()
        try:
            torch.set_num_threads(1)
            registry.set_active_backend(backend)
            result = fn(collective, *args)
            gc.collect()
            results.put((rank, seq, True, (result, _rss_bytes())))
        except BaseException:  # noqa: BLE001 - every failure goes to the parent, SystemExit included
            results.put((rank, seq, False, traceback.format_exc()))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc: never replaced for size
        return 0


class RankPool:
    """``world_size`` ranks kept between calls (see the module docstring)."""

    def __init__(self, world_size: int, max_rss_bytes: int = MAX_RSS_BYTES, backend: str = "cpu") -> None:
        self.world_size = world_size
        self.backend = backend
        self.max_rss_bytes = max_rss_bytes
        self._ranks: dict[str, Any] | None = None

    def _start(self) -> dict[str, Any]:
        from crosstrain.collective import free_port

        ctx = mp.get_context("spawn")
        tasks = [ctx.Queue() for _ in range(self.world_size)]
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_serve, args=(r, self.world_size, port, tasks[r], results, self.backend),
                             daemon=True) for r in range(self.world_size)]
        for p in procs:
            p.start()
        return {"procs": procs, "tasks": tasks, "results": results, "seq": 0}

    def close(self) -> None:
        """Stop the ranks (after a failure, past the memory bound, at the end): they hold nothing to save, and a
        rank blocked in a collective would never read a request to stop."""
        pool, self._ranks = self._ranks, None
        for p in pool["procs"] if pool else []:
            p.kill()
            p.join()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        """Call ``fn(collective, *args)`` on every rank; return the per-rank results in rank order."""
        pool = self._ranks = self._ranks or self._start()
        pool["seq"] += 1
        seq = pool["seq"]
        for q in pool["tasks"]:
            q.put((seq, fn, args))
        results: dict[int, Any] = {}
        error, grown = "", False
        try:
            while len(results) < self.world_size:
                rank, got, ok, payload = pool["results"].get(timeout=timeout)
                if not ok:
                    error = f"rank {rank} failed:\n{payload}"
                    break
                if got == seq:
                    results[rank], rss = payload
                    grown = grown or rss > self.max_rss_bytes
        except Exception as exc:  # queue.Empty on timeout
            error = f"ranks did not finish within {timeout:.0f}s ({type(exc).__name__})"
        if error:
            self.close()
            raise RuntimeError(error)
        if grown:
            self.close()
        return [results[r] for r in range(self.world_size)]
