"""Two real gloo ranks shared by the test session: ``run(fn, *args)`` is ``run_ranks(fn, 2, *args)`` without the
start-up (two spawned interpreters importing torch and crosstrain and joining a process group, several seconds
on 2 cores) that each call of crosstrain.testing.multiprocess.run_ranks pays.

The ranks start on first use and run one call at a time: ``fn(collective, *args)`` on both, results in rank
order, a rank's exception re-raised here with its traceback. After a failure or a timeout the ranks are killed
(one may be blocked in a collective its peer never joins) and the next call starts fresh ones. Each call gets
the settings run_ranks gives (one thread, the cpu backend active); what a call leaves behind in the process
(meshes, caches) is what a second Trainer in one process sees, as under the CLI's launcher. Ranks that have grown
past ``MAX_RSS_BYTES`` after a call are replaced before the next, so the session's memory stays bounded.
A function that leaves the process group unusable on purpose (a rank that never joins a collective, as in
tests/test_moe_ep.py) needs ranks of its own: run_ranks.
"""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

WORLD_SIZE = 2
MAX_RSS_BYTES = 1 << 30
_pool: dict[str, Any] = {}


def _serve(rank: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        import torch

        from crosstrain import registry

        collective = registry.set_active_backend("cpu").collective()
        collective.init(timeout=120)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, False, traceback.format_exc()))
        return
    while True:
        seq, fn, args = tasks.get()
        try:
            torch.set_num_threads(1)
            registry.set_active_backend("cpu")
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


def _start() -> dict[str, Any]:
    from crosstrain.collective import free_port

    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue() for _ in range(WORLD_SIZE)]
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_serve, args=(r, port, tasks[r], results), daemon=True) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    return {"procs": procs, "tasks": tasks, "results": results, "seq": 0}


def close() -> None:
    """Stop the shared ranks (after a failure, past the memory bound, at the end of the session): they hold
    nothing to save, and a rank blocked in a collective would never read a request to stop."""
    pool = _pool.pop("ranks", None)
    for p in pool["procs"] if pool else []:
        p.kill()
        p.join()


def run(fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call ``fn(collective, *args)`` on the shared 2 ranks; return the per-rank results in rank order."""
    pool = _pool.get("ranks") or _pool.setdefault("ranks", _start())
    pool["seq"] += 1
    seq = pool["seq"]
    for q in pool["tasks"]:
        q.put((seq, fn, args))
    results: dict[int, Any] = {}
    error, grown = "", False
    try:
        while len(results) < WORLD_SIZE:
            rank, got, ok, payload = pool["results"].get(timeout=timeout)
            if not ok:
                error = f"rank {rank} failed:\n{payload}"
                break
            if got == seq:
                results[rank], rss = payload
                grown = grown or rss > MAX_RSS_BYTES
    except Exception as exc:  # queue.Empty on timeout
        error = f"ranks did not finish within {timeout:.0f}s ({type(exc).__name__})"
    if error:
        close()
        raise RuntimeError(error)
    if grown:
        close()
    return [results[r] for r in range(WORLD_SIZE)]
