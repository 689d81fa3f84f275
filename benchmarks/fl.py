"""Per-round time of secure (SecAgg+) vs plain FedAvg aggregation: 10 clients x 1M parameters over 127.0.0.1.

The server runs in this process (gRPC with mutual TLS, :mod:`crosstrain.plugins.fl.grpc_transport`); each
client is its own process (``python -m crosstrain.plugins.fl.synthetic``: a seeded random update instead of
local training, so the round time is the aggregation's alone). The same client processes serve every round,
and plain and secure rounds alternate (interleaved repetitions), so both see the same machine state. A round is
timed from sending the global model to the aggregate (plain: the float32 updates travel; secure: the four
SecAgg+ stages, masking and unmasking included). ``vs_flower`` is always null: no Flower SecAgg+
run is implemented; ``vs_flower_note`` says whether ``flwr`` is installed.

Last line: JSON ``{"secure_over_plain": ..., "vs_flower": ..., ...}``; ``stages_s`` is the server's median time per
stage (``train_s``, the SecAgg+ stages' ``advertise_s`` ... ``unmask_s``, and ``aggregate_s`` after training).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from crosstrain.plugins.fl import certs
from crosstrain.plugins.fl.config import FLSection
from crosstrain.plugins.fl.coordinator import Coordinator
from crosstrain.plugins.fl.grpc_transport import serve
from crosstrain.plugins.fl.rounds import run_round
from crosstrain.plugins.fl.synthetic import update


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--dim", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3, help="rounds of each mode (alternating)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pki = certs.generate(Path(tmp) / "certs", args.clients)
        coordinator = Coordinator()
        server, port = serve(coordinator, certs.load(pki, "server"), "127.0.0.1:0", args.clients)
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
        procs = [subprocess.Popen([sys.executable, "-m", "crosstrain.plugins.fl.synthetic", "--address",
                                   f"127.0.0.1:{port}", "--certs", str(pki), "--id", str(c)], env=env)
                 for c in range(args.clients)]
        times: dict[str, list[float]] = {"plain": [], "secure": []}
        errors: dict[str, float] = {}
        stages: dict[str, dict[str, list[float]]] = {"plain": {}, "secure": {}}  # per-stage seconds, server side
        try:
            ids = coordinator.wait_for_clients(args.clients, 300, within_s=300)
            zero = np.zeros(args.dim, np.float32)
            for r in range(2 * args.reps + 2):  # the first plain + secure pair warms up and is not counted
                mode = "secure" if r % 2 else "plain"
                fl = FLSection(clients=args.clients, secure=mode == "secure", stage_timeout_s=600)
                t0 = time.perf_counter()
                out = run_round(coordinator, fl, r, zero, ids, np.random.default_rng(r))
                elapsed = time.perf_counter() - t0
                if out.mean is None or out.survivors != ids:
                    raise RuntimeError(f"round {r} ({mode}) failed: {out.error or out.dropped}")
                w = np.array([1.0 + c % 3 for c in ids])
                exact = (w[:, None] * np.stack([update(0, c, r, args.dim) for c in ids])).sum(0) / w.sum()
                errors[mode] = max(errors.get(mode, 0.0), float(np.abs(out.mean - exact).max()))
                if r >= 2:
                    times[mode].append(elapsed)
                    for key, value in out.stats.items():
                        if key.endswith("_s") and isinstance(value, float):
                            stages[mode].setdefault(key, []).append(value)
                print(f"round {r} {mode}: {elapsed:.3f} s", file=sys.stderr, flush=True)
        finally:
            coordinator.finish()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            server.stop(grace=None)
    plain, secure = statistics.median(times["plain"]), statistics.median(times["secure"])
    flower = importlib.util.find_spec("flwr") is not None
    result = {
        "clients": args.clients, "dim": args.dim, "reps": args.reps, "client_processes": True,
        "plain_round_s": round(plain, 4), "secure_round_s": round(secure, 4),
        "plain_rounds_s": [round(t, 4) for t in times["plain"]],
        "secure_rounds_s": [round(t, 4) for t in times["secure"]],
        "stages_s": {mode: {k: round(statistics.median(v), 4) for k, v in per.items()} for mode, per in stages.items()},
        "max_abs_error_vs_exact_mean": errors,
        "secure_over_plain": round(secure / plain, 3),
        "vs_flower": None,
        "vs_flower_note": ("flwr is installed but the Flower comparison is not implemented" if flower else
                           "flwr is not installed: no Flower SecAgg+ run to compare against"),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
