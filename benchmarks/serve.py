"""``crosstrain serve`` over HTTP: continuous batching's throughput, latency, and the pause a hot swap causes.

A tiny run (the ``tiny`` preset, trained a few steps in this process, checkpointed every step) is served by a
real ``crosstrain serve --watch`` process on 127.0.0.1. Side by side, repetitions interleaved:

- ``sequential``: the ``--clients`` requests (distinct prompts, greedy, ``--new-tokens`` each) one at a time;
- ``concurrent``: the same requests from ``--clients`` threads at once (they share decode steps).

Both must return the same texts (checked: batching never changes a greedy result). ``batching_speedup`` is
concurrent over sequential tokens/s (median over the repetitions; goal >= 3); ``p50_ms``/``p99_ms`` are the
concurrent requests' latencies. Then the swap: the run's newest checkpoint was held back at start (renamed away,
so the server starts on the one before); while the clients stream, it is renamed back (an atomic commit, as the
trainer's) and the server loads, gates and swaps it. ``swap_stall_ms`` is the longest gap between two chunks
(or before the first) that any stream in flight during the swap saw, ``stall_baseline_ms`` the same over a
streaming round without a swap; ``swap_lag_s`` is from the commit to the server's swap (``--poll-s 0.5``: the
look, the load and the gate). ``errors`` counts failed requests (goal 0). JSON on the last line.

    python benchmarks/serve.py [--quick] [--clients 16] [--new-tokens 64] [--reps 3] [--max-batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx


def train_run(run: Path, steps: int) -> None:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    cfg = load_config(None, ["model.preset=tiny", f"train.steps={steps}", "train.seq_len=32", "train.batch_size=4",
                             "checkpoint.every=1", "logging.every=100"])
    Trainer(cfg, run_dir=run).fit()


def start_server(run: Path, max_batch: int, threads: int | None) -> tuple[subprocess.Popen[str], str, list[str]]:
    cmd = [sys.executable, "-m", "crosstrain", "serve", str(run), "--port", "0", "--watch", "--poll-s", "0.5",
           "--max-batch", str(max_batch), "--max-wait-ms", "5"]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    match = re.search(r"http://[\d.]+:\d+", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()[-2000:]}")
    events: list[str] = []
    threading.Thread(target=lambda: events.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    return proc, match.group(0), events


def complete(client: httpx.Client, url: str, prompt: str, n: int) -> tuple[bool, str, float, int]:
    t0 = time.perf_counter()
    try:
        r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                        timeout=600)
    except httpx.HTTPError:
        return False, "", time.perf_counter() - t0, 0
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return False, "", seconds, 0
    body = r.json()
    return True, body["choices"][0]["text"], seconds, body["usage"]["completion_tokens"]


def stream(client: httpx.Client, url: str, prompt: str, n: int) -> tuple[bool, list[float]]:
    """Stream one completion; the arrival times of its chunks (the request's start first)."""
    times = [time.perf_counter()]
    try:
        with client.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                                   "temperature": 0, "stream": True},
                           timeout=600) as r:
            if r.status_code != 200:
                return False, times
            for line in r.iter_lines():
                if line.startswith("data: "):
                    times.append(time.perf_counter())
                    if '"error"' in line:
                        return False, times
    except httpx.HTTPError:
        return False, times
    return True, times


def concurrent(fn: Any, url: str, prompts: list[str], n: int) -> tuple[list[Any], float]:
    results: list[Any] = [None] * len(prompts)
    clients = [httpx.Client() for _ in prompts]

    def work(i: int) -> None:
        results[i] = fn(clients[i], url, prompts[i], n)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return results, wall


def max_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="--new-tokens 32 --reps 2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (0: torch's default)")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.reps = 32, 2
    prompts = [f"Request {i}: the quick brown fox {'jumps ' * (i % 5)}" for i in range(args.clients)]
    with tempfile.TemporaryDirectory(prefix="crosstrain-bench-serve-") as tmp:
        run = Path(tmp) / "run"
        train_run(run, steps=2)
        held = run / "checkpoints" / "step_2"
        aside = run / "held_step_2"
        held.rename(aside)  # serve step 1 first; step 2 is "committed" during the swap round
        proc, url, events = start_server(run, args.max_batch, args.threads or None)
        try:
            out = measure(url, prompts, args, held, aside, events)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    out["load_avg"] = os.getloadavg()[0]
    for key in ("sequential_tokens_per_s", "concurrent_tokens_per_s", "batching_speedup", "p50_ms", "p99_ms",
                "swap_stall_ms", "stall_baseline_ms", "swap_lag_s", "errors"):
        print(f"{key:>24}: {out[key]}")
    print(json.dumps(out))


def measure(url: str, prompts: list[str], args: argparse.Namespace, held: Path, aside: Path,
            events: list[str]) -> dict[str, Any]:
    n = args.new_tokens
    errors = 0
    with httpx.Client() as warm:  # first-call costs (allocations, lazy imports) out of the timings
        complete(warm, url, "warm up", n)
    seq_rates, conc_rates, latencies = [], [], []
    reference: list[str] | None = None
    for _ in range(args.reps):
        with httpx.Client() as client:
            t0 = time.perf_counter()
            alone = [complete(client, url, p, n) for p in prompts]
            seq_wall = time.perf_counter() - t0
        together, conc_wall = concurrent(complete, url, prompts, n)
        errors += sum(not r[0] for r in alone + together)
        texts = [r[1] for r in alone]
        if [r[1] for r in together] != texts or (reference is not None and texts != reference):
            raise SystemExit("batched greedy texts differ from the same requests served alone")
        reference = texts
        seq_rates.append(sum(r[3] for r in alone) / seq_wall)
        conc_rates.append(sum(r[3] for r in together) / conc_wall)
        latencies += [r[2] * 1000 for r in together]
    context = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["context_length"]
    longest = max(len(p.encode()) for p in prompts)  # byte tokenizer: one token per byte
    long_n = min(4 * n, context - longest)  # streams long enough to be in flight when the swap lands
    baseline, _ = concurrent(stream, url, prompts, long_n)  # the same round without a swap
    errors += sum(not ok for ok, _ in baseline)
    # the swap round: streams start, the held-back checkpoint is committed, the server swaps under them
    swapped_before = sum('"swapped"' in e for e in events)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.append(concurrent(stream, url, prompts, long_n)))
    runner.start()
    time.sleep(0.05)
    committed = time.time()
    aside.rename(held)
    runner.join()
    rounds = 0
    while sum('"swapped"' in e for e in events) == swapped_before and rounds < 20:  # swap not yet under a stream
        more, _ = concurrent(stream, url, prompts, n)
        results.append((more, 0.0))
        rounds += 1
    swap_streams = [r for batch, _ in results for r in batch]
    errors += sum(not ok for ok, _ in swap_streams)
    step = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["step"]
    swaps = [json.loads(e.split(": ", 1)[1]) for e in events if '"swapped"' in e]
    latencies.sort()
    seq, conc = statistics.median(seq_rates), statistics.median(conc_rates)
    return {"clients": len(prompts), "new_tokens": n, "reps": args.reps,
            "sequential_tokens_per_s": round(seq, 1), "concurrent_tokens_per_s": round(conc, 1),
            "batching_speedup": round(conc / seq, 2),
            "p50_ms": round(latencies[len(latencies) // 2], 1),
            "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
            "swap_stall_ms": round(1000 * max(max_gap(t) for _, t in swap_streams), 1),
            "stall_baseline_ms": round(1000 * max(max_gap(t) for _, t in baseline), 1),
            "swapped_to_step": step, "swap_lag_s": round(swaps[-1]["time"] - committed, 2) if swaps else None,
            "errors": errors}


if __name__ == "__main__":
    main()
