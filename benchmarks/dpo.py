"""DPO step time: crosstrain's ``dpo`` recipe vs a plain PyTorch DPO loop, and precomputed vs frozen reference.

All runs use the same GPT preset, the embedded preference task, the same batch (``--batch-size`` pairs), AdamW,
clipping and the same loss (``crosstrain.plugins.rlhf.losses.dpo_loss``), in one process. The plain loop does a
policy forward, a reference forward under ``no_grad`` on the concatenated chosen+rejected batch, backward, clip
and step; its step time covers the batch fetch too. crosstrain's is the Trainer's median ``step_time_s``. The
runs alternate ABBA (``--rounds`` rounds, odd ones in reverse order) so machine noise hits all; medians are
compared. Last line JSON: ``overhead_ratio`` (crosstrain / plain, frozen reference), ``precomputed_over_frozen``
(crosstrain step time with ``rlhf.reference = "precomputed"`` / with the frozen copy; ``_cpu``: the same from
the main thread's CPU time per step, which load on the machine barely moves) and ``recipe_loss_ratio``
(the recipe's loss + backward alone vs the plain forwards + loss + backward on one batch, ABBA: the recipe's
share of the overhead; the rest is the loop's optimizer step, clipping and bookkeeping).

What precomputing can save: the frozen step is policy forward F + backward B + optimizer/bookkeeping O + the
reference forward R, the precomputed one lacks R; R <= F (no autograd graph) and B ~ 2F (a gradient for the
input and one for the weight per matmul), so the ratio (F + B + O) / (F + B + O + R) is about 0.75 plus O's
share. It gets there where matmuls dominate (``small``); on ``tiny`` per-op overhead makes B ~ 3F (about 0.8).

    python benchmarks/dpo.py [--preset tiny] [--steps 30] [--batch-size 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from _timing import alternate, seconds, step_clock


def _config(args: argparse.Namespace, *extra: str):  # type: ignore[no-untyped-def]
    from crosstrain.config import load_config

    return load_config(None, [
        "backend=cpu", "train.recipe=dpo", f"model.preset={args.preset}", f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}", "train.seq_len=128", "eval.every=0", "checkpoint.every=0",
        "checkpoint.final=false", "logging.progress=none", "logging.tensorboard=false", "schedule.warmup_steps=5",
        *extra])


def crosstrain_step(args: argparse.Namespace, *extra: str) -> tuple[float, float]:
    """The Trainer's median step time and the median main-thread CPU time per step (the work itself: with one
    intra-op thread, forward, backward and the optimizer all run on the calling thread, so other processes on the
    machine barely move it)."""
    from crosstrain.engine import Trainer

    with step_clock(time.thread_time) as cpu, tempfile.TemporaryDirectory() as d:
        wall = float(Trainer(_config(args, *extra), run_dir=d).fit()["median_step_time_s"])
    return wall, statistics.median(cpu.intervals[2:])


def plain_step(args: argparse.Namespace) -> float:
    from crosstrain.data.tokenizer import ByteTokenizer
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.rlhf.data import encode_preferences
    from crosstrain.plugins.rlhf.losses import dpo_loss, sequence_logps
    from crosstrain.plugins.rlhf.synthetic import preference_rows

    torch.manual_seed(0)
    rows, _ = preference_rows(0.05)
    ds = encode_preferences(ByteTokenizer(), rows, 128, 64)
    ds.with_prompts = False  # as the recipe's training batches (prompts are for eval generation only)
    policy = build_gpt(args.preset)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = ds.batch(rng.choice(len(ds), args.batch_size, replace=False))
        ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:]
        logps, lengths = sequence_logps(policy(ids[:, :-1]), ids[:, 1:], mask)
        with torch.no_grad():
            ref, _ = sequence_logps(reference(ids[:, :-1]), ids[:, 1:], mask)
        pc, pr = logps.chunk(2)
        rc, rr = ref.chunk(2)
        loss = dpo_loss(pc, pr, rc, rr, beta=0.1)[0].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def recipe_loss_ratio(args: argparse.Namespace, reps: int = 20) -> float:
    """The dpo recipe's ``loss`` (metrics included) + backward vs the plain loop's forwards, loss and backward, on
    one batch and model, alternating (ABBA): the recipe's own share of ``overhead_ratio``."""
    from crosstrain.config import load_config
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.rlhf.losses import dpo_loss, sequence_logps
    from crosstrain.plugins.rlhf.recipes import DPORecipe

    recipe = DPORecipe()
    config = load_config(None, ["train.recipe=dpo", f"model.preset={args.preset}", "train.seq_len=128"])
    recipe.validate(config)
    recipe.sec = config.section("rlhf")
    torch.manual_seed(0)
    policy = build_gpt(args.preset)
    models = {"policy": policy, "reference": copy.deepcopy(policy).requires_grad_(False)}
    batch = recipe.dataset.batch(np.arange(args.batch_size))
    ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:]

    def ours() -> None:
        out = recipe.loss(models, batch)
        out.loss.backward()
        [float(v) for v in out.metrics.values()]

    def plain() -> None:
        logps, _ = sequence_logps(policy(ids[:, :-1]), ids[:, 1:], mask)
        with torch.no_grad():
            ref, _ = sequence_logps(models["reference"](ids[:, :-1]), ids[:, 1:], mask)
        dpo_loss(*logps.chunk(2), *ref.chunk(2), beta=0.1)[0].mean().backward()

    def timed(name: str, _round: int) -> float:
        took = seconds({"ours": ours, "plain": plain}[name])
        policy.zero_grad(set_to_none=True)
        return took

    times = alternate(["ours", "plain"], reps, timed)
    return statistics.median(times["ours"]) / statistics.median(times["plain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {"ours": lambda: crosstrain_step(args), "plain": lambda: (plain_step(args), float("nan")),
            "pre": lambda: crosstrain_step(args, "rlhf.reference=precomputed")}
    results = alternate(list(runs), args.rounds, lambda name, _: runs[name]())
    times = {name: [wall for wall, _ in got] for name, got in results.items()}
    cpu = {name: [thread for _, thread in got] for name, got in results.items()}
    o, p, q = (statistics.median(times[name]) for name in runs)
    cpu_ratio = statistics.median(cpu["pre"]) / statistics.median(cpu["ours"])
    loss_ratio = recipe_loss_ratio(args)
    print(f"crosstrain dpo step {o * 1e3:.1f} ms, plain PyTorch {p * 1e3:.1f} ms, precomputed reference "
          f"{q * 1e3:.1f} ms ({args.preset}, {args.batch_size} pairs)")
    print(json.dumps({"overhead_ratio": o / p, "precomputed_over_frozen": q / o,
                      "precomputed_over_frozen_cpu": cpu_ratio, "recipe_loss_ratio": loss_ratio,
                      "crosstrain_step_s": o,
                      "plain_step_s": p, "precomputed_step_s": q, "preset": args.preset,
                      "batch_size": args.batch_size,
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
