"""A test-only malicious-but-authenticated FL client process: a real client certificate, real gRPC over mutual
TLS and the real protocol (crosstrain.plugins.fl.synthetic's participant), but round r's update follows
``--plan``, one word per round:

- ``honest``: the synthetic update, as any client would send it;
- ``nan``: every value NaN;
- ``huge``: the synthetic update scaled to L2 norm 1e6, not clipped to ``fl.clip_norm``, its norm reported truly;
- ``lying``: the same 1e6-norm update, but the train reply reports the honest update's norm (under SecAgg+ the
  server cannot see the update, only the sum).

``python tests/fl_poison_client.py --address HOST:PORT --certs DIR --id K --plan nan,huge``
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from crosstrain.plugins.fl.certs import load
from crosstrain.plugins.fl.client import FLClient, Round
from crosstrain.plugins.fl.grpc_transport import GrpcChannel
from crosstrain.plugins.fl.synthetic import participate

HUGE_NORM = 1e6


class PoisonClient(FLClient):
    plan: list[str] = []

    def _kind(self, rnd: Round) -> str:
        return self.plan[rnd.round] if rnd.round < len(self.plan) else "honest"

    def prepare(self, rnd: Round, update: np.ndarray, weight: float) -> tuple[np.ndarray, float]:
        kind = self._kind(rnd)
        if kind == "nan":
            return np.full_like(update, np.nan), weight
        if kind in ("huge", "lying"):
            self.honest_norm = float(np.linalg.norm(update))
            return (update * (HUGE_NORM / self.honest_norm)).astype(np.float32), weight
        return super().prepare(rnd, update, weight)

    def report(self, rnd: Round, update: np.ndarray, weight: float, loss: float) -> dict[str, Any]:
        fields = super().report(rnd, update, weight, loss)
        if self._kind(rnd) == "lying":
            fields["norm"] = self.honest_norm
        return fields


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--certs", required=True)
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--plan", required=True)
    args = p.parse_args(argv)
    PoisonClient.plan = args.plan.split(",")
    channel = GrpcChannel(args.address, load(args.certs, f"client-{args.id}"))
    try:
        participate(channel, 0, client_type=PoisonClient)
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
