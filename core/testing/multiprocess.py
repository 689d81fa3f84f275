"""Run a function on N real processes joined in a torch.distributed process group (for tests and benchmarks).

Each rank is a spawned process with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT) set, the requested backend made active, and its Collective initialised. The function's return value
(picklable) comes back per rank; an exception in any rank is re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from crosstrain.collective import free_port


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple,
            queue: Any, threads: int) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    try:
        import torch

        torch.set_num_threads(threads)
        from crosstrain import registry

        selected = registry.set_active_backend(backend)
        collective = selected.collective()
        collective.init(timeout=120)
        try:
            result = fn(collective, *args)
        finally:
            collective.destroy()
        queue.put((rank, True, result))
    except BaseException:  # report every failure to the parent, including SystemExit
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, backend: str = "cpu",
              timeout: float = 180.0, threads: int = 1) -> list[Any]:
    """Call ``fn(collective, *args)`` on ``world_size`` processes; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, threads), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"ranks did not finish within {timeout:.0f}s ({type(exc).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
