"""The run's checkpoints: what one holds, resume, save and the rollback after a non-finite streak.

Saves and loads go through :class:`crosstrain.checkpoint.manager.CheckpointManager` (DCP resharding, async
saves, retention); this module decides what goes in (:func:`checkpoint_state`) and when.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.engine.counters import Counters, DataState
from crosstrain.engine.models import FrozenRecord
from crosstrain.engine.run import Run
from crosstrain.errors import CrosstrainError, PluginError

Emit = Callable[[int, str, dict[str, Any]], None]


class TrainingError(CrosstrainError):
    """Training cannot continue (e.g. non-finite loss persists and there is nothing to roll back to)."""

    exit_code = 1


def checkpoint_state(run: Run, counters: Counters, rng: Any) -> dict[str, Any]:
    """What a checkpoint holds: each trainable model + its optimizer (resharding) and schedule, the frozen
    models' record, counters, data position and loss scale, per-rank RNG (``RankLocal``) and the recipe's
    state."""
    from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal

    primary = run.primary
    state: dict[str, Any] = {}
    for m in run.trainable:
        key = m.checkpoint_key(m is primary)
        state[key] = ModelOptimizerState(m.module, m.optimizer)
        state["schedule" if m is primary else f"schedule_{m.name}"] = m.schedule
    if len(run.trainable) != len(run.models):
        state["frozen"] = FrozenRecord(run.models)
    state.update({"trainer": counters, "data": DataState(run.sampler, run.scaler), "rng": RankLocal(rng)})
    for key, value in (run.recipe.state() or {}).items():
        if key in state:
            raise PluginError(f"recipe {run.recipe.name!r} checkpoint key {key!r} clashes with another key")
        state[key] = value
    return state


def steps_done(config: Any, run_dir: str | os.PathLike[str] | None) -> int:
    """The step a run will resume from, read before it is built (no checksum checked, no collective): the
    newest ``step_N`` that ``checkpoint.resume`` names (``auto``: in ``run_dir``, else ``$CROSSTRAIN_RUN_DIR``);
    0 for a fresh run. ``parallel.compile=auto`` weighs the steps left, not ``train.steps``."""
    from crosstrain.checkpoint.manager import step_dirs, step_number
    from crosstrain.engine.state import ENV_RUN_DIR

    resume = config.checkpoint.resume
    if resume == "never":
        return 0
    if resume == "auto":
        chosen = run_dir or os.environ.get(ENV_RUN_DIR)
        if not chosen:
            return 0
        folder = Path(chosen) / "checkpoints"
    else:
        path = Path(resume)
        named = step_number(path.name)
        if named is not None:
            return named
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = step_dirs(folder)
    return found[0][0] if found else 0


class Checkpoints:
    """The run dir's ``checkpoints/``: resume, save and roll back, each with the run's current state."""

    def __init__(self, run: Run, run_dir: Path, counters: Counters, emit: Emit) -> None:
        from crosstrain.checkpoint.app_state import RNGState, has_persistent_buffers
        from crosstrain.checkpoint.manager import CheckpointManager

        cfg = run.config.checkpoint
        self.run, self.counters, self.emit = run, counters, emit
        self.rng = RNGState(run.device_api)
        self.manager = CheckpointManager(
            run_dir / "checkpoints",
            keep_last=cfg.keep_last,
            keep_every=cfg.keep_every,
            async_save=cfg.async_save,
            collective=run.collective,
        )
        # Async saves copy model and optimizer tensors while the next forward/backward runs, fenced before
        # the optimizer step. Modules with persistent buffers may update them in forward (BatchNorm running
        # stats), so such models are staged before save() returns instead.
        defer = cfg.async_save and not any(has_persistent_buffers(m.module) for m in run.trainable)
        self.stage_later = tuple(m.checkpoint_key(m is run.primary) for m in run.trainable) if defer else ()
        self._protected = False
        self.rollbacks_this_run = 0
        self._last_save = time.monotonic()  # checkpoint.every_minutes counts from setup, then from each save

    def time_due(self) -> bool:
        """Whether ``checkpoint.every_minutes`` passed on this rank's clock since the last save (or setup); the
        ranks act on rank 0's answer (:class:`crosstrain.engine.preemption.StopVote`)."""
        minutes = self.run.config.checkpoint.every_minutes
        return minutes > 0 and time.monotonic() - self._last_save >= minutes * 60.0

    def state(self) -> dict[str, Any]:
        return checkpoint_state(self.run, self.counters, self.rng)

    def resume(self) -> int | None:
        """Load the checkpoint ``checkpoint.resume`` names (the newest for ``auto``); returns its step if it
        already reached ``train.steps`` (nothing is loaded: the run is complete), else None."""
        resume = self.run.config.checkpoint.resume
        if resume == "never":
            return None
        from crosstrain.checkpoint.resolve import CHECKPOINT, resolve_path

        target = (self.manager.latest_together() if resume == "auto"
                  else resolve_path(resume, what="checkpoint.resume", accept=CHECKPOINT).info)
        if target is None:
            return None
        if target.step >= self.run.config.train.steps:
            return target.step
        self.counters.step = int(self.manager.load(target, self.state()))
        self.emit(
            self.counters.step,
            "resume",
            {
                "message": f"crosstrain: resumed from {getattr(target, 'path', target)} at step {self.counters.step}",
                "checkpoint": str(getattr(target, "path", target)),
            },
        )
        return None

    def save(self, step: int, best: bool = False) -> None:
        """Save a checkpoint of ``step``; ``best``: it holds the best eval loss so far (``checkpoint.keep_best``
        keeps it, and ``crosstrain export|generate|eval RUN --best`` find it)."""
        cfg = self.run.config.checkpoint
        t0 = time.perf_counter()
        self.manager.save(
            step,
            self.state(),
            stage_later=self.stage_later,  # waits for the last
            best=best and cfg.keep_best,
        )
        self._last_save = time.monotonic()
        # duration_s: how long the loop was held (an async save writes on after it)
        self.emit(step, "checkpoint", {"committed": not cfg.async_save, "duration_s": time.perf_counter() - t0})

    def after_nonfinite(self, consecutive: int) -> int:
        """A step was skipped as non-finite, ``consecutive`` in a row: past ``fault.max_consecutive_nonfinite``
        roll the model and optimizer back to the newest checkpoint and keep going on new data; returns the new
        count. Raises :class:`TrainingError` when there is nothing (more) to roll back to."""
        run, cfg = self.run, self.run.config
        if run.scaler.enabled and run.scaler.scale > 1.0:
            return 0  # fp16 overflow: the lower loss scale is the remedy, not a rollback
        if not self._protected:
            self._protected = True  # the newest checkpoint before the first streak outlives retention (keep_last)
            self.manager.protect_newest()
        if consecutive < cfg.fault.max_consecutive_nonfinite:
            return consecutive
        step = self.counters.step
        info = self.manager.latest_together()
        if info is None:
            every = cfg.checkpoint.every
            # checkpoints are on but none was reached yet: the lr, not the checkpoint setting, is what to change
            fix = (
                (
                    f"lower optim.lr (now {cfg.optim.lr:g}); it diverged before the first checkpoint "
                    f"(checkpoint.every={every})"
                )
                if every
                else "lower optim.lr or set checkpoint.every"
            )
            raise TrainingError(
                f"loss or gradients were non-finite for {consecutive} consecutive steps (up to step "
                f"{step}) and there is no checkpoint to roll back to; {fix}"
            )
        if self.rollbacks_this_run >= cfg.fault.max_rollbacks:
            raise TrainingError(
                f"loss or gradients non-finite again at step {step} after {self.rollbacks_this_run} rollback(s) "
                f"(fault.max_rollbacks={cfg.fault.max_rollbacks}): training diverges; lower optim.lr "
                f"(now {cfg.optim.lr:g}) and resume from {info.path}"
            )
        self.rollbacks_this_run += 1
        sampler_state, counters = run.sampler.state_dict(), self.counters.state_dict()
        schedules = {m.name: m.schedule.state_dict() for m in run.trainable}
        restored = self.manager.load(info, self.state())
        run.sampler.load_state_dict(sampler_state)  # keep going on new data past the bad batches
        self.counters.load_state_dict(counters)
        self.counters.rollbacks += 1
        for m in run.trainable:
            m.schedule.load_state_dict(schedules[m.name])
        self.emit(
            step,
            "rollback",
            {
                "message": f"crosstrain: {consecutive} non-finite steps in a row at step {step}; "
                f"rolled back model and optimizer to the checkpoint of step {restored}",
                "to_step": int(restored),
                "nonfinite_in_a_row": consecutive,
            },
        )
        return 0
