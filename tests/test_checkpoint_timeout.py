"""A collective whose peer is dead-but-connected (SIGSTOPped: sockets open, never answers) raises within the
configured timeout with a CollectiveError naming the operation and the rank, instead of hanging forever."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch.multiprocessing as mp

from crosstrain.collective import free_port
from crosstrain.fault.elastic import elastic_store

TIMEOUT_S = 3.0


def _worker(rank: int, port: int, queue: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch

    from crosstrain import registry
    from crosstrain.errors import CollectiveError

    collective = registry.set_active_backend("cpu").collective()
    collective.init(timeout=TIMEOUT_S)
    collective.all_reduce(torch.ones(2))  # the group works
    if rank == 1:
        queue.put((1, "stopping", 0.0))
        os.kill(os.getpid(), signal.SIGSTOP)  # dead peer that keeps its connections open
        return
    start = time.monotonic()
    try:
        collective.all_reduce(torch.ones(4), op="sum")
        queue.put((0, "no error", time.monotonic() - start))
    except CollectiveError as exc:
        queue.put((0, str(exc), time.monotonic() - start))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((0, f"wrong error {type(exc).__name__}: {exc}", time.monotonic() - start))
    os._exit(0)


def test_hung_peer_raises_naming_op_and_rank() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()  # synchronous put: the workers stop or _exit right after
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + 180
        while len(results) < 2 and time.monotonic() < deadline:
            if queue.empty():
                time.sleep(0.05)
                continue
            rank, message, elapsed = queue.get()
            results[rank] = (message, elapsed)
        assert 0 in results, "rank 0 never reported: the collective hung"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    message, elapsed = results[0]
    assert message.startswith("collective all_reduce on rank 0 failed"), message
    assert f"timeout {TIMEOUT_S:g}s" in message and "peer" in message
    assert elapsed >= TIMEOUT_S * 0.9  # it waited for the timeout, not less...
    assert elapsed < TIMEOUT_S + 60  # ...and did not hang (generous bound: loaded CI machines)


def test_elastic_store_only_under_the_agent_store() -> None:
    import datetime

    assert elastic_store(datetime.timedelta(seconds=1), env={}) is None
    assert elastic_store(datetime.timedelta(seconds=1), env={"TORCHELASTIC_USE_AGENT_STORE": "False",
                                                             "TORCHELASTIC_RESTART_COUNT": "1"}) is None
