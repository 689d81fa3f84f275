"""A client that sends a seeded random update instead of training: for benchmarks and dropout tests.

``python -m crosstrain.plugins.fl.synthetic --address HOST:PORT --certs DIR --id K [--seed S]`` joins like
``crosstrain fl client`` (same TLS identity, same protocol) but imports neither torch nor the CLI, so ten of
them start in well under a second each. Its update in round r is ``update(S, K, r, D)``, where D is the length
of the global vector the server sends (there is no size option: the server decides it).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from crosstrain.plugins.fl.client import Channel, FLClient


def update(seed: int, client: int, round_id: int, dim: int, scale: float = 0.01) -> np.ndarray:
    """The update synthetic client ``client`` sends in ``round_id``: N(0, scale^2) float32, reproducible."""
    return (np.random.default_rng([seed, client, round_id]).standard_normal(dim) * scale).astype(np.float32)


def participate(channel: Channel, seed: int, join_timeout_s: float = 60.0,
                client_type: type[FLClient] = FLClient) -> int:
    """Answer every round until the server is done; returns the number of rounds taken part in."""
    client = client_type(channel, join_timeout_s)
    rnd = client.next_round()
    rounds = 0
    while rnd is not None:
        assert client.client_id is not None
        vec = update(seed, client.client_id, rnd.round, rnd.global_vec.shape[0])
        rnd = client.exchange(rnd, vec, weight=1.0 + client.client_id % 3, loss=float(client.client_id))
        rounds += 1
    return rounds


def main(argv: list[str] | None = None) -> int:
    from crosstrain.plugins.fl.certs import load
    from crosstrain.plugins.fl.grpc_transport import GrpcChannel

    p = argparse.ArgumentParser(prog="python -m crosstrain.plugins.fl.synthetic")
    p.add_argument("--address", required=True)
    p.add_argument("--certs", required=True)
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    channel = GrpcChannel(args.address, load(args.certs, f"client-{args.id}"))
    try:
        rounds = participate(channel, args.seed)
    finally:
        channel.close()
    print(f"synthetic client {args.id}: {rounds} rounds", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
