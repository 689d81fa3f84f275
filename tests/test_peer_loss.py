"""A rank that fails because another rank died is told apart from the rank that died (real gloo processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from crosstrain.collective import free_port
from crosstrain.fault.peer_loss import EXIT_PEER_LOST, first_cause, is_peer_loss

DYING_PEER = '''
import os, sys, torch, torch.distributed as dist
from crosstrain.fault.peer_loss import is_peer_loss
dist.init_process_group("gloo")
x = torch.ones(1 << 16)
for step in range(50):
    if step == 3 and dist.get_rank() == 1:
        os._exit(17)
    try:
        dist.all_reduce(x)
    except RuntimeError as exc:
        print("peer_loss", is_peer_loss(exc), flush=True)
        sys.exit(0)
'''


def test_a_gloo_collective_that_lost_its_peer_is_a_peer_loss(tmp_path) -> None:
    script = tmp_path / "dying_peer.py"
    script.write_text(DYING_PEER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                           "--monitor-interval", "0.5", str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "peer_loss True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_other_failures_are_not_peer_losses() -> None:
    assert not is_peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_loss(ValueError("connection reset by peer"))  # only backend (runtime) errors count
    wrapped = RuntimeError("collective all_reduce on rank 0 failed")
    wrapped.__cause__ = RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    assert is_peer_loss(wrapped)


def test_the_launcher_blames_the_rank_that_died_not_the_one_that_lost_it() -> None:
    # same second (torchelastic stamps exits without an error file when it notices them): rank 0 lost rank 1
    assert first_cause({0: (100, EXIT_PEER_LOST), 1: (100, 17)}) == 1
    assert first_cause({0: (100, 3), 1: (100, 17)}) == 0  # two real failures: the earlier, then the lower rank
    assert first_cause({0: (101, 3), 1: (100, 17)}) == 1
    assert first_cause({0: (100, EXIT_PEER_LOST), 1: (99, EXIT_PEER_LOST)}) == 1
    # the agent stops the survivors with SIGTERM once it sees the first exit
    assert first_cause({0: (100, -signal.SIGTERM), 1: (100, 17)}) == 1
    assert first_cause({0: (100, -signal.SIGTERM), 1: (100, EXIT_PEER_LOST)}) == 1
    assert first_cause({0: (100, -signal.SIGKILL), 1: (100, -signal.SIGTERM)}) == 0  # e.g. the OOM killer
