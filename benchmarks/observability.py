"""Observability overhead: crosstrain's step time with every sink and per-rank metrics on vs all of them off.

Both sides train the same GPT preset with DDP on 2 gloo processes (one thread each). "on": metrics.jsonl,
events.jsonl, TensorBoard (when installed), the Prometheus exporter on a free 127.0.0.1 port, per-rank metrics
with straggler detection and the hang watchdog; "off": metrics.jsonl and events.jsonl only (the loop always
writes them), TensorBoard, Prometheus, per-rank metrics and the watchdog off. A step's time is the wall time
between the ends of consecutive steps, so everything each side does per step counts. The two run in
alternation (``--rounds`` times, ABBA, in the same two processes) so machine noise hits both. Each part's own
cost per step is also timed alone (``parts_us``; ``parts_ratio`` = 1 + their sum / the median "off" step), which
a busy machine cannot blur. Last line: JSON with ``overhead_ratio`` = median "on" step / median "off" step.

    python benchmarks/observability.py [--preset small] [--steps 14] [--rounds 6]
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import tempfile
import time
from typing import Any

import torch.distributed as dist

from crosstrain.testing.multiprocess import run_ranks

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _options(s: dict[str, Any], on: bool, port: int) -> list[str]:
    base = ["backend=cpu", f"model.preset={s['preset']}", f"train.steps={s['steps']}",
            f"train.batch_size={s['batch_size']}", f"train.seq_len={s['seq_len']}", "parallel.dp_replicate=2",
            "parallel.dp_shard=1", "logging.progress=none", "train.threads=1", "eval.every=0", "checkpoint.every=0",
            "checkpoint.final=false"]
    if on:
        return [*base, "logging.tensorboard=true", "observability.per_rank=true", "observability.hang_dump_s=300",
                f"observability.prometheus_port={port}"]
    return [*base, "logging.tensorboard=false", "observability.per_rank=false", "observability.hang_dump_s=0",
            "observability.prometheus_port=0"]


def _fit(s: dict[str, Any], on: bool, port: int, out_dir: str) -> list[float]:
    from crosstrain import hookimpl, pluginmanager
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    ends: list[float] = []

    class StepClock:
        @hookimpl(trylast=True)
        def crosstrain_on_step_end(self, context: Any, step: int, metrics: dict[str, float]) -> None:
            ends.append(time.perf_counter())

    pluginmanager.register(StepClock(), name="observability-step-clock")
    try:
        Trainer(load_config(None, _options(s, on, port)), run_dir=out_dir).fit()
    finally:
        pluginmanager.unregister("observability-step-clock")
    return [b - a for a, b in itertools.pairwise(ends)]


def _alternate(collective: Any, s: dict[str, Any], ports: list[int], rounds: int, warmup: int,
               tmp: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    short = dict(s, steps=6)
    _fit(short, False, 0, f"{tmp}/warmup-off")  # the first run in a fresh process is slower
    _fit(short, True, ports[0], f"{tmp}/warmup-on")
    for r in range(rounds):
        for name in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
            dist.barrier()
            times[name] += _fit(s, name == "on", ports[r + 1], f"{tmp}/{name}{r}")[warmup:]
    return times


def component_costs_us(n: int = 2000) -> dict[str, float]:
    """Each part's own cost per step, in microseconds, timed alone (immune to the machine's noise): a per-rank
    record on rank 0 of 2 (its line, rank 1's new lines read and the step judged), the Prometheus sink's write,
    the TensorBoard sink's write (when installed) and the watchdog's beat."""
    import json as _json
    from pathlib import Path

    from crosstrain.engine.metrics import TensorBoardSink, tensorboard_available
    from crosstrain.engine.ranks import RankMetrics, RankMetricsWriter
    from crosstrain.engine.watchdog import HangWatchdog
    from crosstrain.plugins.observability.prometheus import PrometheusSink

    metrics = {"loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1, "tokens_per_s": 1e4, "mfu": 0.1,
               "time_data_s": 0.001, "time_forward_s": 0.03, "time_backward_s": 0.06, "time_comm_s": 0.001,
               "time_optimizer_s": 0.01, "peak_memory_bytes": 1e9}

    def per_step(fn: Any) -> float:
        t0 = time.perf_counter()
        for step in range(1, n + 1):
            fn(step)
        return (time.perf_counter() - t0) / n * 1e6

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ranks = RankMetrics(tmp, 0, 2, lambda *a: None)
        other = RankMetricsWriter(tmp, 1)
        line = _json.dumps({"step": 0, "rank": 1, "busy_s": 0.01})
        assert other._fh is not None
        fh = other._fh
        out["per_rank"] = per_step(lambda step: (fh.write(line.replace('"step": 0', f'"step": {step}') + "\n"),
                                                 ranks.step_end(step, metrics)))
        other.close()
        ranks.close()
        prom = PrometheusSink(0)
        out["prometheus"] = per_step(lambda step: prom.write(step, metrics))
        prom.close()
        if tensorboard_available():
            tb = TensorBoardSink(Path(tmp) / "tb")
            out["tensorboard"] = per_step(lambda step: tb.write(step, metrics))
            tb.close()
        dog = HangWatchdog(Path(tmp), 0, 300.0, lambda *a: None)
        out["hang_watchdog"] = per_step(dog.beat)
        dog.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="GPT preset (tiny, small, ...)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over the 2 ranks)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="alternating repetitions of each side")
    parser.add_argument("--warmup", type=int, default=2, help="step intervals dropped from each run's start")
    args = parser.parse_args()
    s = {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len}
    ports = [_free_port() for _ in range(args.rounds + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_ranks(_alternate, WORLD, s, ports, args.rounds, args.warmup, tmp, timeout=1800)
    times: dict[str, list[float]] = per_rank[0]
    med = {name: statistics.median(v) for name, v in times.items()}
    costs = component_costs_us()
    print(f"GPT preset {args.preset!r}, global batch {args.batch_size} x seq {args.seq_len}, DDP on {WORLD} gloo "
          f"processes, {args.steps} steps x {args.rounds} rounds (first {args.warmup} intervals dropped)")
    print(f"{'side':<6} {'median step ms':>15} {'p90 ms':>9} {'steps':>6}")
    for name, values in times.items():
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"{name:<6} {1000 * med[name]:>15.2f} {1000 * p90:>9.2f} {len(values):>6}")
    print("each part's own cost per step, timed alone: " + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))
    bound = 1 + sum(costs.values()) / 1e6 / med["off"]
    print(json.dumps({"overhead_ratio": med["on"] / med["off"], "parts_ratio": bound, "median_step_s_on": med["on"],
                      "median_step_s_off": med["off"], "parts_us": costs, "preset": args.preset,
                      "steps": args.steps, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
