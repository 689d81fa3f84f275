"""``crosstrain tune --throughput``: a short grid search over the speed knobs that do not change what is trained,
maximising steady-state tokens/s, with the winner printed as ``--set`` flags.

The knobs: ``train.grad_accum`` (micro-batches per step; ``train.batch_size``, the global batch, stays), activation
checkpointing (``parallel.activation_checkpoint`` none/full: recompute instead of store), ``parallel.compile``
(not on CPU, where compiling takes longer than a short search) and, with ``--nproc`` > 1, ``parallel.layout``
(DDP/FSDP2). Each candidate is a real ``crosstrain train`` run of :data:`STEPS` steps without evaluation or
checkpoints; its speed is ``batch_size x seq_len / median step time`` (the median leaves out the first, compiling
step), read from its summary.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.tune.space import as_set
from crosstrain.plugins.tune.trial import TrialCommand, read_summary

STEPS = 10
SHORT = ("eval.every=0", "checkpoint.every=0", "checkpoint.every_minutes=0", "checkpoint.final=false",
         "logging.tensorboard=false")


def _device_type(backend: str) -> str:
    """The device type the run's backend trains on ("cpu" when none is available)."""
    from crosstrain import registry
    from crosstrain.errors import CrosstrainError

    try:
        return registry.select_backend(backend).backend.device().type
    except CrosstrainError:
        return "cpu"


def knobs(base: Any, nproc: int | None) -> dict[str, list[Any]]:
    """The grid: every value of each knob this config and layout can take."""
    world = nproc or 1
    per_rank = base.train.batch_size // world if base.train.batch_size % world == 0 else 0
    accum = [g for g in (1, 2, 4, 8) if per_rank and per_rank % g == 0] or [base.train.grad_accum]
    grid: dict[str, list[Any]] = {"train.grad_accum": accum, "parallel.activation_checkpoint": ["none", "full"]}
    # compiling on the CPU costs more than it saves in a short search
    # (the run's backend decides, not whichever accelerator torch knows of in this process)
    if _device_type(base.backend) != "cpu":
        grid["parallel.compile"] = [False, True]
    if world > 1:
        grid["parallel.layout"] = ["ddp", "fsdp"]
    return grid


def run_throughput(sets: list[str], config_path: str | None, out: str | None, nproc: int | None,
                   log: Any = sys.stderr) -> dict[str, Any]:
    """Run every candidate once; returns ``{"tokens_per_s", "base_tokens_per_s", "set", "flags", "trials"}``."""
    import itertools
    import os

    from crosstrain.config import load_config

    base = load_config(config_path, sets)
    grid = knobs(base, nproc)
    out_dir = (Path(out) if out else Path(base.train.output_dir) / "tune") / "throughput"
    threads = max(1, (os.cpu_count() or 1) // (nproc or 1))
    command = TrialCommand((*sets, f"train.steps={STEPS}", *SHORT), config_path, nproc, threads, "", "", "")
    keys = list(grid)
    trials: list[dict[str, Any]] = []
    for n, values in enumerate(itertools.product(*grid.values())):
        params = dict(zip(keys, values, strict=True))
        run_dir = out_dir / f"trial_{n:04d}"
        code = command.run(run_dir, params, -1)
        summary = read_summary(run_dir)
        median = summary.get("median_step_time_s") or 0.0
        speed = base.train.batch_size * base.train.seq_len / median if code == 0 and median > 0 else 0.0
        print(f"crosstrain tune: throughput {params}: {speed:,.0f} tok/s" + (f" (exit {code})" if code else ""),
              file=log, flush=True)
        trials.append({"params": params, "tokens_per_s": speed, "run_dir": str(run_dir)})
    best = max(trials, key=lambda t: t["tokens_per_s"])
    if best["tokens_per_s"] <= 0:
        raise ConfigError(f"no throughput candidate trained; see {out_dir}/trial_0000/tune_trial.log")
    current = {k: _current(base, k) for k in keys}
    base_speed = next((t["tokens_per_s"] for t in trials if t["params"] == current), None)
    changed = [as_set(k, v) for k, v in best["params"].items() if current.get(k) != v]
    return {"tokens_per_s": best["tokens_per_s"], "base_tokens_per_s": base_speed, "set": changed,
            "flags": " ".join(f"--set {s}" for s in changed), "trials": trials}


def _current(base: Any, key: str) -> Any:
    from crosstrain.plugins.tune.space import base_value

    return base_value(base, key)
