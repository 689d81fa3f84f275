"""Observability overhead: crosstrain's step time with every sink and per-rank metrics on vs all of them off.

Both sides train the same GPT preset with DDP on 2 gloo processes (one torch thread each, set the same way on
both sides). "on": metrics.jsonl, events.jsonl, TensorBoard (when installed), the Prometheus exporter on a free
127.0.0.1 port, MLflow (file store in the run dir; ``--no-mlflow`` leaves it out), per-rank metrics with
straggler detection and the hang watchdog; "off": metrics.jsonl and events.jsonl only (the loop always writes
them). A step's time is the wall time between the ends of consecutive steps, so everything each side does per
step counts, background threads (TensorBoard's writer, MLflow's flusher, the watchdog) included. The sides run
in alternation (``--rounds`` repetitions each, ABBA, in the same two processes, after one warm-up run of each)
so machine noise hits both; the first ``--warmup`` intervals of every run are dropped. Noise on a shared machine
only ever adds time, so ``overhead_ratio`` is the ratio of the fastest repetition medians (min over repetitions
of the median step time, "on" / "off"); ``pooled_ratio`` (median of all steps) and ``paired_ratio`` (median
over ABBA neighbours of their ratio) are printed with it, and ``mean_ratio``, which unlike the medians also
counts a cost paid once every few seconds (MLflow's batches). Each part's own cost per step is also timed alone
in one process (``parts_us``; ``parts_ratio`` = 1 + their sum / the fastest "off" median), which a busy
machine cannot blur.

    python benchmarks/observability.py [--preset small] [--steps 30] [--rounds 6] [--warmup 3] [--no-mlflow]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import socket
import statistics
import tempfile
import time
from typing import Any

import torch.distributed as dist
from _timing import alternate, step_clock

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
                f"observability.prometheus_port={port}", f"observability.mlflow={str(s['mlflow']).lower()}"]
    return [*base, "logging.tensorboard=false", "observability.per_rank=false", "observability.hang_dump_s=0",
            "observability.prometheus_port=0", "observability.mlflow=false"]


def mlflow_available() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def _fit(s: dict[str, Any], on: bool, port: int, out_dir: str) -> list[float]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    with step_clock() as clock:
        Trainer(load_config(None, _options(s, on, port)), run_dir=out_dir).fit()
    return clock.intervals


def _alternate(collective: Any, s: dict[str, Any], ports: list[int], rounds: int, warmup: int,
               tmp: str) -> dict[str, list[list[float]]]:
    """Per side, one list of step times per repetition, in ABBA order (off on, on off, off on, ...)."""
    short = dict(s, steps=6)
    _fit(short, False, 0, f"{tmp}/warmup-off")  # the first run in a fresh process is slower
    _fit(short, True, ports[0], f"{tmp}/warmup-on")

    def run(name: str, r: int) -> list[float]:
        dist.barrier()
        return _fit(s, name == "on", ports[r + 1], f"{tmp}/{name}{r}")[warmup:]

    return alternate(["off", "on"], rounds, run)


def component_costs_us(n: int = 2000, with_mlflow: bool = False) -> dict[str, float]:
    """Each part's own cost per step, in microseconds, timed alone (immune to the machine's noise): a per-rank
    record on rank 0 of 2 (its line, rank 1's new lines read and the step judged), the Prometheus sink's write,
    the TensorBoard sink's write (when installed), the watchdog's beat and the MLflow sink's write and batches."""
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
        if with_mlflow:
            out["mlflow"] = _mlflow_cost_us(Path(tmp), metrics, n)
    return out


def _mlflow_cost_us(tmp: Any, metrics: dict[str, float], n: int) -> float:
    """The MLflow sink's cost per step: ``n`` writes and the batches that send them, as its thread does."""
    from crosstrain.config import load_config
    from crosstrain.engine.metrics import SinkInfo
    from crosstrain.plugins.observability.mlflow_sink import MlflowSink

    sink = MlflowSink(load_config(None, ["observability.mlflow=true"]))
    sink.open(SinkInfo(run_dir=tmp, rank=0, world_size=2, resume_step=0))
    per_batch = 15  # steps sent per batch: FLUSH_S seconds of ~0.3 s steps
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        sink.write(step, metrics)
        if step % per_batch == 0:
            sink.flush()
    sink.flush()
    cost = (time.perf_counter() - t0) / n * 1e6
    sink.close()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="GPT preset (tiny, small, ...)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over the 2 ranks)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="alternating repetitions of each side")
    parser.add_argument("--warmup", type=int, default=3, help="step intervals dropped from each run's start")
    parser.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=mlflow_available(),
                        help="the MLflow sink on the \"on\" side (default: when mlflow is installed)")
    args = parser.parse_args()
    s = {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
         "mlflow": args.mlflow}
    ports = [_free_port() for _ in range(args.rounds + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_ranks(_alternate, WORLD, s, ports, args.rounds, args.warmup, tmp, timeout=3600)
    reps: dict[str, list[list[float]]] = per_rank[0]
    pooled = {name: statistics.median(itertools.chain(*v)) for name, v in reps.items()}
    rep_medians = {name: [statistics.median(r) for r in v] for name, v in reps.items()}
    fastest = {name: min(v) for name, v in rep_medians.items()}
    mean = {name: statistics.fmean(itertools.chain(*v)) for name, v in reps.items()}
    paired = statistics.median(a / b for a, b in zip(rep_medians["on"], rep_medians["off"], strict=True))
    costs = component_costs_us(with_mlflow=args.mlflow)
    print(f"GPT preset {args.preset!r}, global batch {args.batch_size} x seq {args.seq_len}, DDP on {WORLD} gloo "
          f"processes, {args.steps} steps x {args.rounds} rounds ABBA (first {args.warmup} intervals dropped)")
    print(f"{'side':<6} {'fastest rep median ms':>22} {'pooled median ms':>17} {'p90 ms':>9} {'steps':>6}")
    for name, v in reps.items():
        values = sorted(itertools.chain(*v))
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"{name:<6} {1000 * fastest[name]:>22.2f} {1000 * pooled[name]:>17.2f} {1000 * p90:>9.2f} "
              f"{len(values):>6}")
    print("each part's own cost per step, timed alone: " + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items()))
    bound = 1 + sum(costs.values()) / 1e6 / fastest["off"]
    print(json.dumps({"overhead_ratio": fastest["on"] / fastest["off"], "pooled_ratio": pooled["on"] / pooled["off"],
                      "paired_ratio": paired, "mean_ratio": mean["on"] / mean["off"], "parts_ratio": bound,
                      "median_step_s_on": fastest["on"], "median_step_s_off": fastest["off"],
                      "rep_medians_s": rep_medians, "parts_us": costs, "preset": args.preset, "steps": args.steps,
                      "rounds": args.rounds, "warmup": args.warmup, "mlflow": args.mlflow}))


if __name__ == "__main__":
    main()
