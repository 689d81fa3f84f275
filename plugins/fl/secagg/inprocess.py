"""A whole round in one process, with optional dropouts: the reference transport for tests and simulation."""

from __future__ import annotations

from crosstrain.plugins.fl.secagg.client import ClientSession
from crosstrain.plugins.fl.secagg.server import AggregateResult, ServerSession
from crosstrain.plugins.fl.secagg.wire import STAGES


def run_round_inprocess(server: ServerSession, clients: dict[int, ClientSession],
                        drop_before: dict[str, set[int]] | None = None) -> AggregateResult:
    """Run every stage; a client in ``drop_before[stage]`` goes silent from that stage on (a dropout)."""
    unknown = set(drop_before or {}) - set(STAGES)
    if unknown:
        raise ValueError(f"drop_before has unknown stages {sorted(unknown)}; stages are {', '.join(STAGES)}")
    gone: set[int] = set()
    for stage in STAGES:
        gone |= (drop_before or {}).get(stage, set())
        for cid, request in server.requests(stage).items():
            if cid not in gone:
                server.accept(stage, cid, clients[cid].respond(stage, request))
        server.close_stage(stage)
    return server.result()
