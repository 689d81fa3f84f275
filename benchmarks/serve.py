"""``crosstrain serve`` over HTTP: time to first token, per-token latency and throughput at 1/8/32 clients next to
the same requests one at a time, and the pause a hot swap causes.

A tiny run (the ``tiny`` preset, trained a few steps in this process, checkpointed every step) is served by a
real ``crosstrain serve --watch`` process on 127.0.0.1. Both sides of every comparison run with TCP_NODELAY: the
server sets it on each accepted connection (tests/test_serve_shutdown.py checks it) and httpx's client sets it on
its own, so no reply waits on the delayed-ACK timer (~40 ms) that inflated the one-at-a-time baseline before. At
each level ``c`` in 1, 8, 32, repetitions interleaved:

- ``sequential``: ``c`` streamed requests (distinct prompts, greedy, ``--new-tokens`` each) one at a time;
- ``concurrent``: the same ``c`` requests from ``c`` threads at once (they share decode steps).

Both must return the same texts (checked: batching never changes a greedy result). Per level and side:
``ttft_ms`` (median time from sending a request to its first text chunk), ``per_token_ms`` (median over requests
of the time between its first and last text chunk over the chunks between; one chunk per token with this byte
tokenizer, unless bytes of one character are held together) and ``tokens_per_s`` (all chunks over the round's
wall time). ``reply_ms_1_client``: the median latency of a non-streamed request (``--new-tokens``) from one
client, where a delayed ACK would hold the whole reply. ``batching_speedup`` is concurrent over sequential
tokens/s at 32 clients (median over repetitions).
Then the swap: the run's newest checkpoint was held back at start (renamed away, so the server starts on the one
before); while ``--clients`` streams run, it is renamed back (an atomic commit, as the trainer's) and the server
loads, gates and swaps it. ``swap_stall_ms`` is the longest gap between two chunks (or before the first) that any
stream in flight during the swap saw, ``stall_baseline_ms`` the same over a streaming round without a swap;
``swap_lag_s`` is from the commit to the server's swap (``--poll-s 0.5``: the look, the load and the gate).
``errors`` counts failed requests (goal 0). JSON on the last line.

    python benchmarks/serve.py [--quick] [--clients 16] [--new-tokens 64] [--reps 3] [--max-batch 32]
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

#: clients at once in each latency round
LEVELS = (1, 8, 32)


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


def timed_stream(client: httpx.Client, url: str, prompt: str, n: int) -> tuple[bool, str, list[float]]:
    """Stream one completion: its text and the arrival times of its text chunks (the request's start first)."""
    times, text = [time.perf_counter()], ""
    try:
        with client.stream("POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                                   "temperature": 0, "stream": True},
                           timeout=600) as r:
            if r.status_code != 200:
                return False, text, times
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                body = json.loads(line[len("data: "):])
                if "error" in body:
                    return False, text, times
                if body["choices"][0]["text"]:
                    times.append(time.perf_counter())
                    text += body["choices"][0]["text"]
    except httpx.HTTPError:
        return False, text, times
    return len(times) > 1, text, times


def latency(results: list[tuple[bool, str, list[float]]], wall: float) -> dict[str, float]:
    """Median time to first token and per-token latency (ms) of a round's streams, and its tokens/s."""
    ttft = [t[1] - t[0] for _, _, t in results if len(t) > 1]
    per_token = [(t[-1] - t[1]) / (len(t) - 2) for _, _, t in results if len(t) > 2]
    tokens = sum(len(t) - 1 for _, _, t in results)
    return {"ttft_ms": 1000 * statistics.median(ttft) if ttft else float("nan"),
            "per_token_ms": 1000 * statistics.median(per_token) if per_token else float("nan"),
            "tokens_per_s": tokens / wall}


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
    parser.add_argument("--clients", type=int, default=16, help="streams in flight during the swap")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=32)
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
    print(f"{'clients':>8} {'ttft_ms':>18} {'per_token_ms':>18} {'tokens_per_s':>20}   (concurrent / one at a time)")
    for c, level in out["levels"].items():
        conc, seq = level["concurrent"], level["sequential"]
        print(f"{c:>8} " + " ".join(f"{conc[k]:>9} / {seq[k]:<{w}}" for k, w in
                                    (("ttft_ms", 6), ("per_token_ms", 6), ("tokens_per_s", 8))))
    for key in ("reply_ms_1_client", "batching_speedup", "swap_stall_ms", "stall_baseline_ms", "swap_lag_s", "errors"):
        print(f"{key:>24}: {out[key]}")
    print(json.dumps(out))


def measure(url: str, prompts: list[str], args: argparse.Namespace, held: Path, aside: Path,
            events: list[str]) -> dict[str, Any]:
    n = args.new_tokens
    errors = 0
    with httpx.Client() as warm:  # first-call costs (allocations, lazy imports) out of the timings
        complete(warm, url, "warm up", n)
    with httpx.Client() as client:  # non-streamed: where a delayed ACK would hold the whole reply
        replies = [complete(client, url, f"Reply {i}: the quick brown fox", n) for i in range(8 * args.reps)]
    errors += sum(not r[0] for r in replies)
    reply_ms = round(1000 * statistics.median(r[2] for r in replies), 2)
    levels: dict[str, dict[str, Any]] = {}
    for c in LEVELS:
        asked = [f"Request {i}: the quick brown fox {'jumps ' * (i % 5)}" for i in range(c)]
        rounds: dict[str, list[dict[str, float]]] = {"concurrent": [], "sequential": []}
        for _ in range(args.reps):
            with httpx.Client() as client:
                t0 = time.perf_counter()
                alone = [timed_stream(client, url, p, n) for p in asked]
                seq_wall = time.perf_counter() - t0
            together, conc_wall = concurrent(timed_stream, url, asked, n)
            errors += sum(not r[0] for r in alone + together)
            if [r[1] for r in together] != [r[1] for r in alone]:
                raise SystemExit("batched greedy texts differ from the same requests served alone")
            rounds["sequential"].append(latency(alone, seq_wall))
            rounds["concurrent"].append(latency(together, conc_wall))
        levels[str(c)] = {side: {k: round(statistics.median(r[k] for r in rs), 2) for k in rs[0]}
                          for side, rs in rounds.items()}
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
    top = levels[str(LEVELS[-1])]
    return {"new_tokens": n, "reps": args.reps, "max_batch": args.max_batch, "tcp_nodelay": "server and client",
            "levels": levels, "reply_ms_1_client": reply_ms,
            "ttft_ms_1_client": levels["1"]["concurrent"]["ttft_ms"],
            f"tokens_per_s_{LEVELS[-1]}_clients": top["concurrent"]["tokens_per_s"],
            "sequential_tokens_per_s": top["sequential"]["tokens_per_s"],
            "batching_speedup": round(top["concurrent"]["tokens_per_s"] / top["sequential"]["tokens_per_s"], 2),
            "swap_clients": len(prompts), "swap_stall_ms": round(1000 * max(max_gap(t) for _, t in swap_streams), 1),
            "stall_baseline_ms": round(1000 * max(max_gap(t) for _, t in baseline), 1),
            "swapped_to_step": step, "swap_lag_s": round(swaps[-1]["time"] - committed, 2) if swaps else None,
            "errors": errors}


if __name__ == "__main__":
    main()
