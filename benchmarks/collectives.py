"""Collective bandwidth: crosstrain's Collective vs raw torch.distributed, side by side, on 2 gloo processes.

For all_reduce, all_gather, reduce_scatter and all_to_all at sizes from 1 KB to 64 MB, prints algbw and busbw
(nccl-tests definitions: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce, * (n-1)/n for the others;
bytes is the larger of the input and output buffers) for both, and their ratio. The two implementations are
timed call by call in adjacent pairs (order alternating) on the same buffers, so machine noise hits both alike: the
reported ratio is the median over pairs of raw time / crosstrain time, and the bandwidths use each side's median
call time. A second pass times raw torch.distributed against itself the same way (the method's noise floor).
Last line: JSON with ``worst_ratio`` (the lowest ratio at sizes >= 1 MB).

    python benchmarks/collectives.py [--world 2] [--max-mb 64] [--reps 201]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _timing import alternate

from crosstrain.collective import Collective, _all_gather_single, _reduce_scatter_single
from crosstrain.testing.multiprocess import run_ranks

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _calls(op: str, c: Collective, nbytes: int, n: int):
    """(crosstrain call, raw torch.distributed call) doing the same work on the same buffers."""
    numel = max(n, nbytes // 4 // n * n)
    if op == "all_reduce":
        t = torch.ones(numel)
        return (lambda: c.all_reduce(t)), (lambda: dist.all_reduce(t)), numel * 4
    if op == "all_gather":
        inp, out = torch.ones(numel // n), torch.empty(numel)
        return (lambda: c.all_gather(out, inp)), (lambda: _all_gather_single(out, inp)), numel * 4
    if op == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // n)
        return (lambda: c.reduce_scatter(out, inp)), (lambda: _reduce_scatter_single(out, inp)), numel * 4
    inp, out = torch.ones(numel), torch.empty(numel)
    return (lambda: c.all_to_all(out, inp)), (lambda: dist.all_to_all_single(out, inp)), numel * 4


def _timed(fn, iters: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank defines the collective's time
    return float(elapsed.item()) / iters


def bench(c: Collective, sizes: list[int], reps: int, null: bool = False) -> list[dict]:
    """Time every op and size; with ``null`` both sides are raw torch.distributed (the method's noise floor)."""
    n = c.world_size
    rows = []
    for op in OPS:
        for size in sizes:
            ours, raw, nbytes = _calls(op, c, size, n)
            if null:
                ours = _calls(op, c, size, n)[1]
            for fn in (ours, raw):  # warm up both paths
                _timed(fn, 3)
            # single calls in adjacent pairs (order alternating), so each pair sees the same machine state;
            # more pairs for small, fast messages
            pairs = max(reps, min(2000, int(4e8 // max(nbytes, 1))))
            calls = {"ours": ours, "raw": raw}
            got = alternate(list(calls), pairs, lambda name, _, calls=calls: _timed(calls[name], 1))
            t_ours, t_raw = got["ours"], got["raw"]
            ratio = statistics.median(r / o for r, o in zip(t_raw, t_ours, strict=True))
            best_ours, best_raw = statistics.median(t_ours), statistics.median(t_raw)
            alg_ours, alg_raw = nbytes / best_ours / 1e9, nbytes / best_raw / 1e9
            f = bus_factor(op, n)
            rows.append({"op": op, "bytes": nbytes, "time_us_crosstrain": best_ours * 1e6,
                         "time_us_raw": best_raw * 1e6, "algbw_crosstrain": alg_ours, "busbw_crosstrain": alg_ours * f,
                         "algbw_raw": alg_raw, "busbw_raw": alg_raw * f, "ratio": ratio})
    return rows


def _rank_main(c: Collective, sizes: list[int], reps: int, with_null: bool) -> tuple[list, list] | None:
    rows = bench(c, sizes, reps)
    null_rows = bench(c, sizes, reps, null=True) if with_null else []
    return (rows, null_rows) if c.rank == 0 else None


def worst_at_1mb(rows: list[dict]) -> tuple[float, dict]:
    big = [r for r in rows if r["bytes"] >= 1 << 20]
    if not big:
        return float("nan"), {}
    row = min(big, key=lambda r: r["ratio"])
    return row["ratio"], row


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'op':15s}{'bytes':>12s}{'algbw ct':>10s}{'busbw ct':>10s}{'algbw raw':>10s}{'busbw raw':>10s}"
          f"{'ratio':>8s}")
    for r in rows:
        print(f"{r['op']:15s}{r['bytes']:>12d}{r['algbw_crosstrain']:>10.3f}{r['busbw_crosstrain']:>10.3f}"
              f"{r['algbw_raw']:>10.3f}{r['busbw_raw']:>10.3f}{r['ratio']:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--min-kb", type=int, default=1)
    parser.add_argument("--max-mb", type=int, default=64)
    parser.add_argument("--reps", type=int, default=201,
                        help="minimum number of call pairs per op and size (small messages get up to 2000)")
    parser.add_argument("--no-null", action="store_true",
                        help="skip the second pass that times raw torch.distributed against itself (noise floor)")
    args = parser.parse_args()
    sizes = []
    size = args.min_kb * 1024
    while size <= args.max_mb * 1024 * 1024:
        sizes.append(size)
        size *= 4
    rows, null_rows = run_ranks(_rank_main, args.world, sizes, args.reps, not args.no_null, backend="cpu",
                                timeout=3600)[0]
    print_table(rows, f"gloo, {args.world} processes; GB/s from median call times; "
                      "ratio = median over adjacent pairs of raw time / crosstrain time")
    worst, worst_row = worst_at_1mb(rows)
    big = [r["ratio"] for r in rows if r["bytes"] >= 1 << 20]
    result = {"worst_ratio": round(worst, 4), "worst_at": {"op": worst_row.get("op"), "bytes": worst_row.get("bytes")},
              "median_ratio_ge_1mb": round(statistics.median(big), 4) if big else None,
              "world_size": args.world, "backend": "gloo", "reps": args.reps}
    if null_rows:
        # the same measurement with raw torch.distributed on both sides: ratios this far from 1 are noise
        print_table(null_rows, "noise floor: raw torch.distributed timed against itself, same method")
        null_worst, _ = worst_at_1mb(null_rows)
        null_big = [r["ratio"] for r in null_rows if r["bytes"] >= 1 << 20]
        result["null_worst_ratio"] = round(null_worst, 4)
        result["null_median_ratio_ge_1mb"] = round(statistics.median(null_big), 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
