"""summary.json and the defaults report: what a finished run trained, how fast, and what the fast defaults chose."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.engine import fast_defaults
from crosstrain.engine.counters import Counters
from crosstrain.engine.models import TrainedModel
from crosstrain.engine.run import Run
from crosstrain.engine.state import params_sha256


def defaults_report(run: Run) -> dict[str, Any]:
    """What the fast defaults chose and why (summary.json ``defaults``; ``crosstrain train -v``)."""
    layout, optimizer, cfg = run.dims.layout_choice, run.primary.optimizer, run.config
    return {
        "optimizer": {
            "impl": getattr(optimizer, "crosstrain_impl", "custom"),
            "class": type(optimizer).__name__,
            "requested": cfg.optim.impl,
        },
        "kernels": {"mode": cfg.kernels.mode, **fast_defaults.kernel_choices(run.device.type)},
        "compile": {"enabled": run.compile_choice.enabled, "reason": run.compile_choice.reason},
        "layout": {
            "choice": run.primary.parallel.layout_name,
            "reason": layout.reason if layout else "",
            "requested": cfg.parallel.layout,
        },
    }


def describe_defaults(report: dict[str, Any]) -> str | None:
    """The one line ``crosstrain train -v`` prints about the defaults report; None unless logging at INFO."""
    if not logging.getLogger("crosstrain").isEnabledFor(logging.INFO):
        return None
    kernels = ", ".join(f"{op}={impl}" for op, impl in report["kernels"].items() if op != "mode")
    opt, comp, lay = report["optimizer"], report["compile"], report["layout"]
    return (
        f"crosstrain: optimizer {opt['class']} (optim.impl={opt['requested']} -> {opt['impl']}); "
        f"kernels ({report['kernels']['mode']}): {kernels}; compile "
        f"{'on' if comp['enabled'] else 'off'} ({comp['reason']}); layout {lay['choice']} ({lay['reason']})"
    )


@dataclass
class LoopRecord:
    """What the loop measured, for the summary."""

    start: float  # perf_counter() when the run began
    first_step: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)  # each step's real (non-padding) tokens
    padding: list[float] = field(default_factory=list)  # each step's padding positions

    def add_step(self, metrics: dict[str, float]) -> None:
        """Record one step's loss, time and tokens (the loop's metrics of it)."""
        self.losses.append(metrics["loss"])
        self.step_times.append(metrics["step_time_s"])
        self.tokens.append(metrics["tokens"])
        self.padding.append(metrics["padding_tokens"])
    train_s: float = 0.0  # the loop's time without evaluations
    preempted: bool = False
    eval_record: bool = False  # summary.json gets eval_before / eval_after
    eval_before: dict[str, float] | None = None
    eval_after: dict[str, float] | None = None
    last_eval_loss: float = float("nan")


def steady_tokens_per_s(record: LoopRecord) -> float:
    """Real tokens per second of the steps after this run's first: the first step compiles (``compile_s``) and
    warms the allocator and caches, so it is left out, as the live rate of the step records leaves it out."""
    skip = 1 if len(record.step_times) > 1 else 0
    seconds = sum(record.step_times[skip:])
    return sum(record.tokens[skip:]) / seconds if seconds > 0 else 0.0


def compile_seconds(run: Run, step_times: list[float]) -> float:
    """The first step's excess over the median of the others (compiling happens in its forward/backward);
    rank 0 records it and the median step time, compiled or eager, for the next run's compile decision."""
    rest = sorted(step_times[1:])
    median = rest[len(rest) // 2] if rest else 0.0
    choice = run.compile_choice
    if not (choice.enabled and step_times):
        if run.is_main and rest and choice.key and run.config.parallel.compile == "auto":
            fast_defaults.write_record(choice.key, eager_step_s=median)
        return 0.0
    compile_s = max(step_times[0] - median, 0.0)
    if run.is_main and choice.key:
        fast_defaults.write_record(choice.key, compile_s=compile_s, **({"compiled_step_s": median} if rest else {}))
    return compile_s


def build_summary(
    run: Run,
    counters: Counters,
    record: LoopRecord,
    final_state_dict: dict[str, torch.Tensor],
    defaults: dict[str, Any],
    run_dir: Path,
) -> dict[str, Any]:
    """summary.json's content (a collective: other trainable models' weights are gathered for their hash)."""
    cfg, step = run.config, counters.step
    steps_run = step - record.first_step
    tokens_per_s = steady_tokens_per_s(record)
    peak = run.peak_flops
    mfu = (run.flops_per_token * tokens_per_s / (peak * run.world_size)) if peak else 0.0
    finite_losses = [v for v in record.losses if math.isfinite(v)]
    compile_s = compile_seconds(run, record.step_times)
    defaults["compile"]["compile_s"] = compile_s
    padding, real = sum(record.padding), sum(record.tokens)
    times = sorted(record.step_times)
    summary: dict[str, Any] = {
        "backend": run.backend.name,
        "recipe": run.recipe.name,
        "world_size": run.world_size,
        "mesh": run.dims.mesh_shape(),
        "steps": step,
        "steps_this_run": steps_run,
        "initial_loss": counters.initial_loss,
        "final_loss": finite_losses[-1] if finite_losses else float("nan"),
        "losses": record.losses,
        "tokens_per_s": tokens_per_s,
        "tokens": real,
        "padding_tokens": padding,
        "padded_fraction": padding / (real + padding) if real + padding else 0.0,
        "mfu": mfu,
        "mfu_flops": run.mfu_flops,
        "peak_memory_bytes": int(run.device_api.memory_stats().peak),
        # every rank's own device (what "it fits" is about; rank 0's alone hides an uneven layout)
        "peak_memory_bytes_per_rank": run.collective.all_gather_object(int(run.device_api.memory_stats().peak)),
        "memory_capacity_bytes": int(run.device_api.memory_stats().total),
        "median_step_time_s": times[len(times) // 2] if times else 0.0,
        "wall_s": time.perf_counter() - record.start,
        "params_sha256": params_sha256(final_state_dict),
        "nonfinite_steps": counters.nonfinite_steps,
        "rollbacks": counters.rollbacks,
        "preempted": record.preempted,
        "run_dir": str(run_dir),
        "precision": cfg.precision.dtype,
        "peak_flops": {"flops": peak, "source": run.device_api.peak_flops_source(run.dtype)},
        "eval_loss": record.last_eval_loss,
        "best_eval_loss": counters.best_eval_loss,
        "best_eval_step": counters.best_eval_step,
        "optim_impl": defaults["optimizer"]["impl"],
        "compile_s": compile_s,
        "compile_estimate_s": run.compile_choice.estimate_s,
        "compile_saving_s": run.compile_choice.saving_s,
        "compile_decision": run.compile_choice.decision,
        "defaults": defaults,
    }
    if len(run.models) > 1:
        summary["models"] = models_summary(run.models, run.primary, summary["params_sha256"])
    if record.eval_record:  # {"loss": ..., "<metric>": ...}; eval_before is null on a resumed run
        for key, found in (("eval_before", record.eval_before), ("eval_after", record.eval_after)):
            summary[key] = {k[len("eval/") :]: v for k, v in found.items() if k.startswith("eval/")} if found else None
    if cfg.eval.tasks:  # the last evaluation's benchmark scores: {"<task>/<metric>": value}
        summary["eval_tasks"] = {k[len("eval/"):]: v for k, v in (record.eval_after or {}).items()
                                 if k.startswith("eval/") and k.count("/") >= 2}
    summary.update(run.recipe.summary())
    return summary


def models_summary(models: dict[str, TrainedModel], primary: TrainedModel, primary_sha: str) -> dict[str, Any]:
    """Every model's role, source and hash (trainable ones: of their trained weights; a collective)."""
    out: dict[str, Any] = {}
    for name, m in models.items():
        if m is primary:
            sha = primary_sha
        else:
            sha = params_sha256(m.parallel.full_state_dict()) if m.trainable else m.sha256
        out[name] = {"trainable": m.trainable, "source": m.source, "params_sha256": sha}
    return out


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` (NaN and inf written as null: JSON has neither)."""
    text = json.dumps(_finite_or_none(summary), indent=2, default=str)
    atomic_write(run_dir / "summary.json", text + "\n")


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value
