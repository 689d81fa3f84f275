"""A rendezvous store that is fresh for every elastic restart attempt.

Under torchrun's c10d rendezvous the agent hosts the TCPStore that workers' ``env://`` init connects to, and
it keeps its keys across restarts. Process groups of attempt N+1 then read the addresses published by the
dead workers of attempt N and fail with "Gloo connectFullMesh failed ... Connection refused". Prefixing the
store with the restart count gives every attempt its own key space.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any


def elastic_store(timeout: datetime.timedelta, env: Mapping[str, str] | None = None) -> Any | None:
    """A ``PrefixStore("crosstrain/attempt_<n>", agent TCPStore)`` under torchelastic's agent store, else None."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"crosstrain/attempt_{int(env['TORCHELASTIC_RESTART_COUNT'])}", store)
