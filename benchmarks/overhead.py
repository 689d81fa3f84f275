"""Framework overhead: the crosstrain Trainer vs a plain hand-written PyTorch DDP loop, side by side.

Both train the same GPT preset on the same embedded corpus with DDP on 2 gloo processes (one thread each),
with the same optimizer (AdamW, decay on matrices), warmup + cosine schedule and gradient clipping. A step's
time is the wall time between the ends of consecutive steps, so everything each loop does per step counts
(for crosstrain: data, metrics.jsonl, hooks, the preemption flag). The frameworks run in alternation
(``--rounds`` times, ABBA, in the same two processes) so machine noise hits both; HF accelerate and Lightning
Fabric are added when installed. Last line: JSON with ``overhead_ratio`` = median crosstrain step / median plain step.

    python benchmarks/overhead.py [--preset small] [--steps 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import json
import math
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _timing import StepClock, alternate, step_clock

from crosstrain.testing.multiprocess import run_ranks

WORLD = 2


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"preset": args.preset, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "lr": 3e-3, "warmup": 5, "grad_clip": 1.0, "weight_decay": 0.1, "seed": 0}


# ---------------------------------------------------------------------------------------------------- crosstrain
def crosstrain_worker(collective: Any, s: dict[str, Any], out_dir: str) -> list[float]:
    with step_clock() as clock:
        _fit_crosstrain(s, out_dir)
    return clock.intervals


def _fit_crosstrain(s: dict[str, Any], out_dir: str) -> None:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    config = load_config(None, [
        "backend=cpu", f"model.preset={s['preset']}", f"train.steps={s['steps']}",
        f"train.batch_size={s['batch_size']}", f"train.seq_len={s['seq_len']}", f"train.seed={s['seed']}",
        f"optim.lr={s['lr']}", f"optim.grad_clip={s['grad_clip']}", f"optim.weight_decay={s['weight_decay']}",
        f"schedule.warmup_steps={s['warmup']}", "parallel.dp_replicate=2", "parallel.dp_shard=1",
        "logging.progress=none", "logging.tensorboard=false", "train.threads=1",
    ])
    Trainer(config, run_dir=out_dir).fit()


# ---------------------------------------------------------------------------------------------------- plain DDP
def plain_worker(collective: Any, s: dict[str, Any], out_dir: str) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from crosstrain.data.corpus import corpus_tokens
    from crosstrain.models.gpt import build_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(s["seed"])
    # the rope tables are constant buffers: skip their per-forward broadcast, as crosstrain does
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        sync: dict[str, Any] = {"forward_sync_buffers": False}
    else:
        sync = {"broadcast_buffers": False}
    model = DDP(build_gpt(s["preset"], vocab_size=256), **sync)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}], lr=s["lr"], betas=(0.9, 0.95))

    def factor(step: int) -> float:
        if step < s["warmup"]:
            return (step + 1) / s["warmup"]
        progress = (step - s["warmup"]) / max(s["steps"] - s["warmup"], 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    tokens = torch.from_numpy(corpus_tokens().astype("int64"))
    seq, batch = s["seq_len"], s["batch_size"]
    n_samples = (len(tokens) - 1) // seq
    offsets = torch.arange(seq + 1)
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(s["seed"]))
    per_rank = batch // world
    ends: list[float] = []
    for step in range(s["steps"]):
        start = (step * batch) % (n_samples - batch)
        idx = perm[start + rank * per_rank : start + (rank + 1) * per_rank]
        rows = tokens[idx[:, None] * seq + offsets]
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        float(reported)
        ends.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(ends)]


# ---------------------------------------------------------------------------------------------------- optional
def accelerate_worker(collective: Any, s: dict[str, Any], out_dir: str) -> list[float]:
    from accelerate import Accelerator

    from crosstrain.data.corpus import corpus_tokens
    from crosstrain.models.gpt import build_gpt

    acc = Accelerator(cpu=True)
    torch.manual_seed(s["seed"])
    model = build_gpt(s["preset"], vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=s["weight_decay"])
    model, opt = acc.prepare(model, opt)
    return _simple_loop(s, model, opt, acc.backward, lambda: acc.clip_grad_norm_(model.parameters(), s["grad_clip"]),
                        corpus_tokens())


def fabric_worker(collective: Any, s: dict[str, Any], out_dir: str) -> list[float]:
    from lightning.fabric import Fabric

    from crosstrain.data.corpus import corpus_tokens
    from crosstrain.models.gpt import build_gpt

    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy="ddp")
    fabric.launch()
    torch.manual_seed(s["seed"])
    model = build_gpt(s["preset"], vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=s["weight_decay"])
    model, opt = fabric.setup(model, opt)
    return _simple_loop(s, model, opt, fabric.backward,
                        lambda: fabric.clip_gradients(model, opt, max_norm=s["grad_clip"]), corpus_tokens())


def _simple_loop(s: dict[str, Any], model: Any, opt: Any, backward: Any, clip: Any, corpus: Any) -> list[float]:
    tokens = torch.from_numpy(corpus.astype("int64"))
    seq, per_rank = s["seq_len"], s["batch_size"] // WORLD
    rank = dist.get_rank()
    offsets = torch.arange(seq + 1)
    clock = StepClock()
    for step in range(s["steps"]):
        idx = torch.arange(per_rank) + (step * s["batch_size"] + rank * per_rank)
        rows = tokens[idx[:, None] * seq + offsets]
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))
        backward(loss)
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        clock.tick()
    return clock.intervals


# ---------------------------------------------------------------------------------------------------- driver
WORKERS = {"plain": plain_worker, "crosstrain": crosstrain_worker, "accelerate": accelerate_worker,
           "fabric": fabric_worker}


def _alternate(collective: Any, s: dict[str, Any], names: list[str], rounds: int, warmup: int,
               tmp: str) -> dict[str, list[float]]:
    """Run every framework ``rounds`` times in turn, in the same two processes and process group."""
    short = dict(s, steps=8)
    for i, name in enumerate(names + names[::-1]):  # untimed warm-up: the first loop run in a fresh process is slower
        WORKERS[name](collective, short, f"{tmp}/warmup-{name}{i}")

    def run(name: str, r: int) -> list[float]:
        dist.barrier()
        return WORKERS[name](collective, s, f"{tmp}/{name}{r}")[warmup:]

    return {name: [t for times in runs for t in times] for name, runs in alternate(names, rounds, run).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="GPT preset (tiny, small, ...)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (split over the 2 ranks)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="alternating repetitions of every framework")
    parser.add_argument("--warmup", type=int, default=2, help="step intervals dropped from each run's start")
    args = parser.parse_args()
    s = _settings(args)
    frameworks = {"plain": plain_worker, "crosstrain": crosstrain_worker}
    skipped = []
    if importlib.util.find_spec("accelerate") is not None:
        frameworks["accelerate"] = accelerate_worker
    else:
        skipped.append("accelerate (not installed)")
    if importlib.util.find_spec("lightning") is not None:
        frameworks["fabric"] = fabric_worker
    else:
        skipped.append("lightning fabric (not installed)")
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_ranks(_alternate, WORLD, s, list(frameworks), args.rounds, args.warmup, tmp, timeout=900)
    times: dict[str, list[float]] = per_rank[0]
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["plain"]
    print(f"GPT preset {args.preset!r}, global batch {args.batch_size} x seq {args.seq_len}, DDP on {WORLD} gloo "
          f"processes, {args.steps} steps x {args.rounds} rounds (first {args.warmup} intervals dropped)")
    print(f"{'framework':<12} {'median step ms':>15} {'p90 ms':>9} {'ratio vs plain':>15}")
    for name, v in times.items():
        p90 = sorted(v)[int(0.9 * (len(v) - 1))]
        print(f"{name:<12} {1000 * med[name]:>15.2f} {1000 * p90:>9.2f} {med[name] / base:>15.3f}")
    for item in skipped:
        print(f"skipped: {item}")
    result = {"overhead_ratio": round(med["crosstrain"] / base, 4), "preset": args.preset,
              "crosstrain_median_step_s": med["crosstrain"], "plain_median_step_s": base,
              "samples_per_framework": len(times["plain"])}
    for name in frameworks:
        if name not in ("plain", "crosstrain"):
            result[f"{name}_ratio"] = round(med[name] / base, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
