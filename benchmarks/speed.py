"""Speed by default (issue 21): crosstrain's defaults vs a plain PyTorch DDP loop, HF accelerate and Lightning Fabric.

Every framework trains the same GPT preset (vocabulary 256, the embedded corpus), fp32, the same global batch
and sequence length, AdamW (betas 0.9/0.95, decay on matrices where the peer's idiom does so) with gradient
clipping at 1.0, on 2 gloo processes with one intra-op thread each (what ``torchrun`` gives every worker). The
peers are the loops of ``benchmarks/overhead.py``; crosstrain runs with its defaults only (``optim.impl``,
``parallel.layout``, ``parallel.compile`` and the kernels all left on ``auto``). The frameworks alternate in the
same two processes (one untimed warm-up run each, then ABBA order, ``--rounds`` times) so machine noise hits all
of them; each run's first ``--warmup`` step intervals are dropped, and tokens/s is global batch x seq / the
median step time.

Peak memory is measured apart, one framework per pair of fresh processes (a short run): the peak resident set
of the larger rank, imports included. (How far each timed run raised the RSS in the shared processes is also
printed as ``rss_growth_shared_bytes``, but memory one run freed and the allocator kept blurs it.) crosstrain's
compile time (summary ``compile_s``, 0 when ``parallel.compile=auto`` chose not to compile) is reported for its
first run on its own. MFU (``100m``) is against the measured one-thread CPU peak (backends/cpu/peak.py) x 2.
A peer that is not installed (``pip install crosstrain[bench]``) is reported as null.
``speedup_bound`` is Amdahl's bound on any speedup over the plain loop that keeps the fp32 matmuls (the same
BLAS calls in every framework): 1 / their share of the plain loop's profiled step (:func:`matmul_share`).

    python benchmarks/speed.py [--presets small,100m] [--rounds 2] [--quick]

Last line: JSON with ``vs_raw``, ``vs_accelerate``, ``vs_fabric`` (crosstrain tokens/s / the peer's, the lower
of the presets), ``memory_vs_raw`` (crosstrain peak / raw peak, the higher of the presets) and per-preset detail.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (the peers' loops, shared with benchmarks/overhead.py)
from _timing import alternate, step_clock  # noqa: E402

from crosstrain.hostmem import current_rss, peak_rss, reset_peak_rss  # noqa: E402
from crosstrain.testing.multiprocess import run_ranks  # noqa: E402

WORLD = overhead.WORLD
#: (global batch, seq len, steps per run) per preset; --quick shortens the runs
SHAPES = {"tiny": (16, 128, 12), "small": (16, 128, 12), "100m": (8, 128, 6)}


def crosstrain_defaults_worker(collective: Any, s: dict[str, Any], out_dir: str) -> tuple[list[float], dict]:
    """crosstrain with its defaults; returns the step intervals and what the defaults chose."""
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    config = load_config(None, [
        "backend=cpu", f"model.preset={s['preset']}", "model.vocab_size=256", f"train.steps={s['steps']}",
        f"train.batch_size={s['batch_size']}", f"train.seq_len={s['seq_len']}", f"train.seed={s['seed']}",
        f"optim.lr={s['lr']}", f"optim.grad_clip={s['grad_clip']}", f"optim.weight_decay={s['weight_decay']}",
        f"schedule.warmup_steps={s['warmup']}", "logging.progress=none", "logging.tensorboard=false",
        "eval.every=0", "checkpoint.final=false",
    ])
    with step_clock() as clock:
        summary = Trainer(config, run_dir=out_dir).fit()
    chosen = {"optim_impl": summary["optim_impl"], "compile_s": summary["compile_s"],
              "layout": summary["defaults"]["layout"]["choice"],
              "compile": summary["defaults"]["compile"]["enabled"]}
    return clock.intervals, chosen


def _peer(name: str) -> Any:
    return {"raw": overhead.plain_worker, "accelerate": overhead.accelerate_worker,
            "fabric": overhead.fabric_worker}[name]


def _one_run(collective: Any, name: str, s: dict[str, Any], out_dir: str) -> tuple[list[float], int, dict]:
    gc.collect()
    dist.barrier()
    reset_peak_rss()
    base = current_rss()
    chosen: dict = {}
    if name == "crosstrain":
        times, chosen = crosstrain_defaults_worker(collective, s, out_dir)
    else:
        times = _peer(name)(collective, s, out_dir)
    peak = torch.tensor([peak_rss() - base], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return times, int(peak.item()), chosen


def _alternate(collective: Any, s: dict[str, Any], names: list[str], rounds: int, warmup: int,
               tmp: str) -> dict[str, Any]:
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for every worker; crosstrain's auto picks 1 too
    short = dict(s, steps=3)
    for name in names:  # untimed: every framework's first-use imports and allocator growth, before any measurement
        _one_run(collective, name, short, f"{tmp}/warmup-{name}")
    runs = alternate(names, rounds, lambda name, r: _one_run(collective, name, s, f"{tmp}/{name}{r}"))
    return {"times": {n: [t for got, _, _ in runs[n] for t in got[warmup:]] for n in names},
            "peaks": {n: [peak for _, peak, _ in runs[n]] for n in names},
            "first": runs["crosstrain"][0][2] if runs.get("crosstrain") else {}}


def _memory_only(collective: Any, name: str, s: dict[str, Any], tmp: str) -> int:
    """Peak resident set of one framework's run in fresh processes (imports included; the larger rank)."""
    torch.set_num_threads(1)
    _one_run(collective, name, s, f"{tmp}/memory-{name}")
    peak = torch.tensor([peak_rss()], dtype=torch.int64)  # the reset kept the RSS reached by then (imports)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


#: the ops whose time no framework-level default removes: the fp32 matmuls (same BLAS for every framework) and
#: attention's fused kernels
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def matmul_share(s: dict[str, Any], steps: int = 2) -> float:
    """The share of one rank's plain-loop step (forward, backward, clip, AdamW) spent in :data:`MATMUL_OPS`,
    single process, one thread, under ``torch.profiler``. ``1 / share`` bounds any framework's speedup over the
    plain loop that leaves the matmuls as they are (Amdahl's law)."""
    from torch.profiler import ProfilerActivity, profile

    from crosstrain.models.gpt import build_gpt

    torch.set_num_threads(1)
    torch.manual_seed(s["seed"])
    model = build_gpt(s["preset"], vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=s["weight_decay"])
    x = torch.randint(0, 256, (s["batch_size"] // WORLD, s["seq_len"] + 1))

    def step() -> None:
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    return sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS) / total


def _preset(preset: str, names: list[str], rounds: int, warmup: int, quick: bool) -> dict[str, Any]:
    batch, seq, steps = SHAPES[preset]
    if quick:
        steps = max(warmup + 3, steps // 2)
    s = {"preset": preset, "steps": steps, "batch_size": batch, "seq_len": seq, "lr": 3e-3, "warmup": 2,
         "grad_clip": 1.0, "weight_decay": 0.1, "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(_alternate, WORLD, s, names, rounds, warmup, tmp, timeout=3000)[0]
        # memory in fresh processes, one framework each: in the shared ones the allocator's leftovers blur it
        memory = {n: run_ranks(_memory_only, WORLD, n, dict(s, steps=warmup + 2), tmp, timeout=1200)[0]
                  for n in names}
    tokens = batch * seq
    out: dict[str, Any] = {"batch_size": batch, "seq_len": seq, "steps": steps, "rounds": rounds,
                           "crosstrain_chose": got["first"]}
    for name in names:
        med = statistics.median(got["times"][name])
        growth = int(statistics.median(got["peaks"][name]))
        out[name] = {"median_step_s": med, "tokens_per_s": tokens / med, "peak_rss_bytes": memory[name],
                     "rss_growth_shared_bytes": growth, "samples": len(got["times"][name])}
    out["matmul_share"] = matmul_share(s)
    out["speedup_bound"] = 1 / out["matmul_share"]
    if preset == "100m":
        from crosstrain.backends.cpu.device import CpuDevice
        from crosstrain.models.gpt import build_gpt

        torch.set_num_threads(1)
        peak = CpuDevice().peak_flops(torch.float32)
        fpt = build_gpt(preset, vocab_size=256).flops_per_token(seq)
        out["mfu"] = {n: fpt * out[n]["tokens_per_s"] / (peak * WORLD) for n in names}
        out["peak_flops_per_rank"] = peak
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,100m")
    parser.add_argument("--rounds", type=int, default=2, help="alternating repetitions of every framework")
    parser.add_argument("--warmup", type=int, default=2, help="step intervals dropped from each run's start")
    parser.add_argument("--quick", action="store_true", help="one round, half the steps, the small preset only "
                        "unless --presets is given")
    args = parser.parse_args()
    presets = args.presets.split(",")
    if args.quick:
        args.rounds = 1
        if "--presets" not in sys.argv:
            presets = ["small"]
    names = ["crosstrain", "raw"]
    missing = {}
    for peer, module in (("accelerate", "accelerate"), ("fabric", "lightning")):
        if importlib.util.find_spec(module) is not None:
            names.append(peer)
        else:
            missing[peer] = f"{module} is not installed (pip install crosstrain[bench])"
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    results = {p: _preset(p, names, args.rounds, args.warmup, args.quick) for p in presets}
    for preset, r in results.items():
        print(f"preset {preset}: global batch {r['batch_size']} x seq {r['seq_len']}, fp32, {WORLD} gloo ranks x 1 "
              f"thread, {r['steps']} steps x {r['rounds']} rounds; crosstrain chose {r['crosstrain_chose']}")
        print(f"  {'framework':<11} {'median step ms':>15} {'tokens/s':>10} {'peak MiB':>9} {'speedup':>8}")
        for name in names:
            x = r[name]
            print(f"  {name:<11} {1000 * x['median_step_s']:>15.1f} {x['tokens_per_s']:>10.0f} "
                  f"{x['peak_rss_bytes'] / 2**20:>9.0f} {r['crosstrain']['tokens_per_s'] / x['tokens_per_s']:>8.3f}")
        print(f"  plain loop's matmul + attention share {r['matmul_share']:.1%}: no default that leaves them as they "
              f"are can exceed {r['speedup_bound']:.2f}x over it")
        if "mfu" in r:
            print("  MFU: " + ", ".join(f"{n} {v:.1%}" for n, v in r["mfu"].items()))
    for peer, why in missing.items():
        print(f"skipped {peer}: {why}")
    print(f"load average while measuring: {' '.join(load)} (start)")

    def ratio(peer: str) -> float | None:
        if peer not in names:
            return None
        return round(min(r["crosstrain"]["tokens_per_s"] / r[peer]["tokens_per_s"] for r in results.values()), 4)

    final = {
        "vs_raw": ratio("raw"), "vs_accelerate": ratio("accelerate"), "vs_fabric": ratio("fabric"),
        "memory_vs_raw": round(max(r["crosstrain"]["peak_rss_bytes"] / r["raw"]["peak_rss_bytes"]
                                   for r in results.values()), 4),
        "compile_s_first_run": {p: r["crosstrain_chose"].get("compile_s") for p, r in results.items()},
        "mfu_100m": results["100m"]["mfu"]["crosstrain"] if "100m" in results else None,
        "matmul_share": {p: round(r["matmul_share"], 4) for p, r in results.items()},
        "speedup_bound": round(min(r["speedup_bound"] for r in results.values()), 3),
        "presets": {p: {n: {"tokens_per_s": round(r[n]["tokens_per_s"], 1), "peak_rss_bytes": r[n]["peak_rss_bytes"]}
                        for n in names} for p, r in results.items()},
        "missing": missing, "loadavg": load, "quick": args.quick,
    }
    print(json.dumps(final))


if __name__ == "__main__":
    main()
