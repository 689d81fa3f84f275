"""One optimizer step of a run, in the order docs/recipes.md states.

1. draw the step's ``grad_accum`` micro-batches and move them to the device;
2. ``recipe.prepare_step(micro_batches, context)``;
3. forward and backward of each micro-batch (gradient sync on the last only);
4. fence an async checkpoint save, unscale, clip, optimizer step (skipped
   when the loss or a gradient norm is non-finite), loss-scale update, LR schedule;
5. ``recipe.after_optimizer_step(context, step)``, then the plugins' ``crosstrain_after_optimizer_step``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from crosstrain import pluginmanager
from crosstrain.collective import global_sums
from crosstrain.engine import step as stepmod
from crosstrain.engine.counters import Counters
from crosstrain.engine.run import Run
from crosstrain.parallel.grad import clip_coefficient


def step_tokens(run: Run, micro: list[Any]) -> tuple[float, float]:
    """The step's real (non-padding) tokens and its token positions over all data-parallel ranks. Padding is
    what the recipe's ``batch_tokens`` reports; without it every position of ``batch_size x seq_len`` counts."""
    counted = [c for c in (run.recipe.batch_tokens(b) for b in micro) if c is not None]
    if not counted or len(counted) < len(micro):
        total = float(run.config.train.batch_size * run.config.train.seq_len)
        return total, total
    real = torch.stack([torch.as_tensor(n, dtype=torch.float64, device=run.device) for n, _ in counted]).sum()
    both = torch.stack([real, torch.tensor(float(sum(p for _, p in counted)), dtype=torch.float64, device=run.device)])
    # tp/pp ranks hold copies of their dp rank's batch: count each batch once
    tokens, positions = global_sums(both, run.world_size // run.sampler.dp_size).tolist()
    return tokens, positions


def train_step(run: Run, counters: Counters, checkpoints: Any = None) -> dict[str, float]:
    """One optimizer step (``grad_accum`` micro-batches); returns the step's metrics. ``checkpoints``: the
    :class:`~crosstrain.checkpoint.manager.CheckpointManager` whose async save the step fences, if any."""
    cfg, recipe, trainable = run.config, run.recipe, run.trainable
    t0 = time.perf_counter()
    draws = run.sampler.next_step()
    set_epoch = getattr(run.dataset, "set_epoch", None)
    if set_epoch is not None:  # per-sample augmentation is seeded by (train.seed, epoch, index): docs/recipes.md
        set_epoch(run.sampler.epoch)
    micro = [stepmod.to_device(run.dataset.batch(idx), run.device) for idx in draws]
    micro = recipe.prepare_step(micro, run.context)
    t_data = time.perf_counter() - t0
    tokens, positions = step_tokens(run, micro)
    primary = run.primary
    lr = primary.schedule.lr
    ga = len(micro)
    losses = []
    sums: dict[str, torch.Tensor] = {}
    times: dict[str, float] = {}
    for i, batch in enumerate(micro):
        if ga > 1:
            for m in trainable:
                m.parallel.set_gradient_sync(i == ga - 1)
        loss, extra, timings = stepmod.forward_backward(
            recipe, run.models, primary, batch, scale=run.scaler.scale, divisor=ga
        )
        losses.append(loss)
        for key, value in extra.items():
            sums[key] = sums[key] + value if key in sums else value
        for key, value in (timings or {}).items():
            name = key if key.startswith("time_") else f"time_{key}"
            name = name if name.endswith("_s") else f"{name}_s"
            times[name] = times.get(name, 0.0) + float(value)
    loss_value = float(sum(float(v) for v in losses) / ga)
    t_opt = time.perf_counter()
    if checkpoints is not None:
        checkpoints.fence()  # an async save may still be copying parameters and optimizer state
        # A failed async save raises here, on every rank, on the step after it failed. The agreement (a small
        # collective) was started at the end of the previous step and has completed during this one's compute.
        checkpoints.check_background()
    next_step = counters.step + 1
    for m in trainable:  # every optimizer and clipping see gradients laid out as their params
        m.parallel.align_grads_()
    run.scaler.unscale_([p for m in trainable for p in m.params])
    grad_norms: dict[str, float] = {}
    step_args: dict[str, dict[str, float]] = {}  # a fused step's grad_scale: clipping applied as it reads a grad
    for m in trainable:
        if cfg.optim.grad_clip > 0 and getattr(m.optimizer, "takes_grad_scale", False):
            norm = m.parallel.grad_norm()  # the fused step scales each gradient in registers: one pass fewer
            step_args[m.name] = {"grad_scale": float(clip_coefficient(norm, cfg.optim.grad_clip))}
        else:
            norm = m.parallel.clip_grad_norm_(cfg.optim.grad_clip)
        grad_norms[m.name] = float(norm)
    grad_norm = grad_norms[primary.name]  # 0: measure only
    finite = math.isfinite(loss_value) and all(math.isfinite(g) for g in grad_norms.values())
    for m in trainable:
        assert m.optimizer is not None
        if finite:
            m.optimizer.step(**step_args.get(m.name, {}))
        m.optimizer.zero_grad(set_to_none=True)
    run.scaler.update(finite)
    run.device_api.synchronize()
    now = time.perf_counter()
    counters.step = next_step
    if finite:
        for m in trainable:
            m.schedule.step()
    recipe.after_optimizer_step(run.context, next_step)
    pluginmanager.call_strict(
        "crosstrain_after_optimizer_step", "act after the optimizer step", context=run.context, step=next_step
    )
    step_time = now - t0
    metrics: dict[str, float] = {
        "loss": loss_value,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_time_s": step_time,
        "tokens": tokens,
        "padding_tokens": positions - tokens,
        "tokens_per_s": tokens / step_time,
        "time_data_s": t_data,
        **times,
        "time_optimizer_s": now - t_opt,
    }
    metrics.update({f"grad_norm/{n}": g for n, g in grad_norms.items() if n != primary.name})
    if sums:
        names = list(sums)
        values = (torch.stack([sums[n] for n in names]) / ga).tolist()  # one host sync for all of them
        metrics.update(dict(zip(names, values, strict=True)))
    if run.peak_flops > 0:
        metrics["mfu"] = run.flops_per_token * tokens / step_time / (run.peak_flops * run.world_size)
    metrics["peak_memory_bytes"] = float(run.device_api.memory_stats().peak)
    for m in trainable:
        memory_report = getattr(m.optimizer, "memory_report", None)
        if memory_report is not None:  # optimizer-state offload: host bytes and device bytes saved
            metrics.update({k: float(v) for k, v in memory_report().items()})
    if run.scaler.enabled:
        metrics["loss_scale"] = run.scaler.scale
    if not finite:
        metrics["skipped"] = 1.0
    return metrics
