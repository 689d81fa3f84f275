"""The training loop: ``Trainer(config).fit()`` builds the :class:`~crosstrain.engine.run.Run` and runs its steps
with every guarantee the loop owns.

The loop owns counters, gradient accumulation, clipping, mixed precision and fp16 loss scaling, the async
checkpoint fence and background check, the preemption vote, the non-finite skip and rollback, metrics,
resume and teardown; the recipe (:mod:`crosstrain.engine.recipe`, ``lm`` by default) owns what is trained.
The Trainer composes small parts, each given only what it needs: :func:`~crosstrain.engine.run.build_run`
(backend, process group, mesh, models, data), :mod:`~crosstrain.engine.loop` (one step),
:mod:`~crosstrain.engine.checkpointing` (checkpoint state, resume, save, rollback),
:mod:`~crosstrain.engine.events` (events and metric sinks) and :mod:`~crosstrain.engine.summary`
(summary.json and the defaults report). Every check that can fail on a user mistake runs before the run dir
is created, so a bad config writes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from crosstrain import pluginmanager
from crosstrain.config import Config, save_config
from crosstrain.engine.checkpointing import Checkpoints, TrainingError, steps_done
from crosstrain.engine.context import RunContext
from crosstrain.engine.counters import Counters
from crosstrain.engine.events import Events
from crosstrain.engine.loop import train_step
from crosstrain.engine.models import TrainedModel
from crosstrain.engine.preemption import PreemptionWatcher, StopVote
from crosstrain.engine.ranks import RankMetrics
from crosstrain.engine.recipe import Recipe
from crosstrain.engine.resume_hint import resume_command
from crosstrain.engine.run import Run, build_run
from crosstrain.engine.state import agree_run_dir
from crosstrain.engine.summary import LoopRecord, build_summary, defaults_report, describe_defaults, write_summary
from crosstrain.engine.watchdog import HangWatchdog
from crosstrain.errors import CheckpointError, ConfigError, PluginError
from crosstrain.runlock import RunDirLock, lock_together

__all__ = ["Trainer", "TrainingError"]


class Trainer:
    """``Trainer(config).fit()`` trains and returns the summary (also written to ``summary.json``).

    ``recipe``: a recipe instance to train (e.g. the federated client's); None resolves ``train.recipe``.
    Hooks receive :attr:`context`, a :class:`~crosstrain.engine.context.RunContext`, never the Trainer.
    ``resume_argv``: the ``crosstrain`` arguments that started the run, named in the resume hint
    (:func:`~crosstrain.engine.resume_hint.resume_command`); None names the run's config.toml instead.
    """

    def __init__(self, config: Config, run_dir: str | Path | None = None, recipe: Recipe | None = None,
                 resume_argv: Sequence[str] | None = None) -> None:
        self.config = config
        self.requested_run_dir = run_dir
        self.resume_argv = resume_argv
        self._given_recipe = recipe
        self.run: Run | None = None
        self.run_dir: Path | None = None
        self.counters = Counters()
        self.events: Events | None = None
        self.checkpoints: Checkpoints | None = None
        self.preemption = PreemptionWatcher()
        self.rank_metrics: RankMetrics | None = None
        self.hang_watchdog: HangWatchdog | None = None
        self.stop_vote: StopVote | None = None
        self._run_lock: RunDirLock | None = None
        self.complete_at: int | None = None  # the newest checkpoint already reached train.steps
        self.summary: dict[str, Any] = {}
        self.final_state_dict: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ what hooks and tests read
    @property
    def built(self) -> Run:
        if self.run is None:
            raise RuntimeError("the run is not built yet; call Trainer.setup() or fit() first")
        return self.run

    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def rank(self) -> int:
        return self.built.rank

    @property
    def world_size(self) -> int:
        return self.built.world_size

    @property
    def is_main(self) -> bool:
        return self.built.is_main

    @property
    def context(self) -> RunContext:
        return self.built.context

    @property
    def models(self) -> dict[str, TrainedModel]:
        return self.built.models

    @property
    def primary(self) -> TrainedModel:
        """The first trainable model: summary.json's ``params_sha256`` and ``final_state_dict`` describe it."""
        return self.built.primary

    @property
    def trainable(self) -> list[TrainedModel]:
        return self.built.trainable

    @property
    def model(self) -> torch.nn.Module:
        return self.primary.module

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the run, then the run dir (locked: one job per run dir), checkpoints and resume, the metric
        sinks, ``config.toml``, per-rank metrics, the hang watchdog and the preemption vote."""
        cfg = self.config
        resume = cfg.checkpoint.resume
        if resume not in ("auto", "never"):  # 'auto' and 'never' are the other choices
            from crosstrain.checkpoint.resolve import CHECKPOINT, source_kind

            source_kind(resume, what="checkpoint.resume", accept=CHECKPOINT)
        if self.requested_run_dir is not None and Path(self.requested_run_dir).is_file():
            raise ConfigError(f"--run-dir {str(self.requested_run_dir)!r} is a file; pass a directory")
        run = self.run = build_run(cfg, self._given_recipe, start_step=steps_done(cfg, self.requested_run_dir))
        events = self.events = Events(run.is_main)
        run.context.attach(lambda: self.counters.step, events.emit, self._request_stop)
        self.run_dir = agree_run_dir(run.collective, self.requested_run_dir, cfg.train.output_dir)
        self._run_lock = lock_together(run.collective, self.run_dir)  # creates it; one job per run dir
        run.context.run_dir = self.run_dir
        self.checkpoints = Checkpoints(run, self.run_dir, self.counters, events.emit)
        self.complete_at = self.checkpoints.resume()
        if self.complete_at is not None:
            return  # nothing to train: the run dir stays exactly as it is
        run.context.resume_step = self.counters.step
        events.open_sinks(cfg, self.run_dir, run.world_size, self.counters.step, run.recipe.data_split(),
                          headline=run.recipe.headline_metrics)
        if run.is_main:  # only now: a rejected resume or a busy metrics port must leave the run's config as it was
            save_config(cfg, self.run_dir)
        self.rank_metrics = RankMetrics.for_run(
            cfg, self.run_dir, run.rank, run.world_size, events.emit, self.counters.step
        )
        self.hang_watchdog = HangWatchdog.for_run(cfg, self.run_dir, run.rank, events.emit, self.counters.step)
        self.preemption.install()
        self.stop_vote = StopVote(run.collective, self.preemption, run.device)

    def _request_stop(self, reason: str) -> None:
        self.preemption.requested = True
        self.preemption.signal_name = self.preemption.signal_name or reason

    def _plugin_error(self, plugin: str, exc: BaseException) -> None:
        assert self.events is not None
        self.events.plugin_error(self.counters.step, plugin, exc)

    # ------------------------------------------------------------------ the loop
    def train_step(self) -> dict[str, float]:
        """One optimizer step (``grad_accum`` micro-batches); returns the step's metrics."""
        return train_step(self.built, self.counters, self.checkpoints.manager if self.checkpoints else None)

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or until SIGTERM) and return the summary."""
        start = time.perf_counter()
        try:
            self.setup()
            if self.complete_at is not None:
                return self._already_complete()
            return self._fit(start)
        except PluginError as exc:  # a strict hook stopped the run: the sinks see why before they close
            if self.events is not None:
                self.events.emit(self.counters.step, "plugin_error", {"error": str(exc), "fatal": True})
            raise
        finally:
            try:
                self.teardown()
            finally:
                if self._run_lock is not None:
                    self._run_lock.release()  # last: an in-flight save still writes into the run dir

    def _eval_due(self, step: int, saving: bool) -> bool:
        cfg = self.config
        if self.built.eval is None or not cfg.eval.every:
            return False
        return step % cfg.eval.every == 0 or step == cfg.train.steps or (cfg.checkpoint.keep_best and saving)

    def _fit(self, start: float) -> dict[str, Any]:
        run, cfg, counters = self.built, self.config, self.counters
        assert self.events is not None and self.checkpoints is not None and self.stop_vote is not None
        events, checkpoints, stop_vote = self.events, self.checkpoints, self.stop_vote
        run.device_api.reset_peak_memory_stats()
        defaults = defaults_report(run)
        line = describe_defaults(defaults)
        if line:
            events.log(line)
        every = cfg.checkpoint.every
        consecutive = 0
        first_step = counters.step
        record = LoopRecord(start=start, first_step=first_step)
        last_saved = first_step if first_step else -1
        loop_start = time.perf_counter()
        eval_time = 0.0
        on_step_end = bool(pluginmanager.plugin_manager().hook.crosstrain_on_step_end.get_hookimpls())
        # a recipe with eval_at_start (e.g. rlhf's) is also evaluated before its first step: eval_before/eval_after
        record.eval_record = run.recipe.eval_at_start and run.eval is not None
        if record.eval_record and first_step == 0:
            record.eval_before = run.evaluate()
            eval_time += record.eval_before.get("time_eval_s", 0.0)
        while counters.step < cfg.train.steps:
            vote = stop_vote.start(counters.step - first_step, record.step_times, checkpoints.time_due())
            metrics = self.train_step()
            step = counters.step
            saving = stop_vote.save_due(vote) or bool(every and step % every == 0)  # the same on every rank
            if step == 1 or not math.isfinite(counters.initial_loss):
                if math.isfinite(metrics["loss"]):
                    counters.initial_loss = metrics["loss"]
            record.add_step(metrics)
            if metrics.get("skipped"):
                counters.nonfinite_steps += 1
                consecutive = checkpoints.after_nonfinite(consecutive + 1)
            else:
                consecutive = 0
            best = False
            if self._eval_due(step, saving):
                results = run.evaluate()
                metrics.update(results)
                eval_time += results.get("time_eval_s", 0.0)
                record.last_eval_loss = results.get("eval/loss", float("nan"))
                best = counters.record_eval(step, record.last_eval_loss)
                record.eval_after = results
            if on_step_end:
                pluginmanager.call_each(
                    "crosstrain_on_step_end",
                    context=run.context,
                    step=step,
                    metrics=metrics,
                    on_error=self._plugin_error,
                )
            if self.rank_metrics is not None:  # every rank, its own file: no collective (crosstrain.engine.ranks)
                self.rank_metrics.step_end(step, metrics)
            if self.hang_watchdog is not None:
                self.hang_watchdog.beat(step)
            events.write(step, metrics)
            if saving and not consecutive:  # never a checkpoint of a diverging model
                checkpoints.save(step, best=best)
                last_saved = step
            checkpoints.manager.start_check()  # finished by check_background() in the next step, without waiting
            if stop_vote.finish(vote):
                record.preempted = True
                break
        record.train_s = time.perf_counter() - loop_start - eval_time  # tokens/s measures training alone
        return self._finish(record, consecutive, last_saved, defaults)

    def _finish(
        self, record: LoopRecord, consecutive: int, last_saved: int, defaults: dict[str, Any]
    ) -> dict[str, Any]:
        """The last checkpoint, the final weights, summary.json and ``crosstrain_after_train``."""
        run, cfg, step = self.built, self.config, self.counters.step
        assert self.events is not None and self.checkpoints is not None and self.run_dir is not None
        events, checkpoints = self.events, self.checkpoints
        signal = self.preemption.signal_name or "SIGTERM"
        if record.preempted:
            events.emit(step, "preemption", {"signal": signal})
        # checkpoint.final: every finished run keeps what it trained; a preempted one always saves, to resume
        if last_saved != step and (record.preempted or cfg.checkpoint.final):
            checkpoints.save(step, best=self.counters.best_eval_step == step)  # the last eval may be the best
        checkpoints.manager.wait()
        checkpoints.manager.check_background()
        self.final_state_dict = run.primary.parallel.full_state_dict()
        self.summary = build_summary(run, self.counters, record, self.final_state_dict, defaults, self.run_dir)
        run.context.summary = self.summary
        run.context.final_state_dict = self.final_state_dict
        if run.is_main:
            write_summary(self.run_dir, self.summary)
        if record.preempted:
            events.log(
                f"crosstrain: {signal} received; finished step {step}, saved a checkpoint in "
                f"{self.run_dir}/checkpoints; exiting. Resume with: {self.resume_command()}"
            )
        losses = record.losses
        if consecutive or (losses and not math.isfinite(losses[-1])):  # never "done" on a diverged run
            raise TrainingError(
                f"training ended at step {step} with a non-finite loss or gradients "
                f"({consecutive or 1} step(s) in a row skipped); lower optim.lr (now "
                f"{cfg.optim.lr:g}) and resume from {self.run_dir}"
            )
        pluginmanager.call_strict(
            "crosstrain_after_train", "finish after training", context=run.context, run_dir=str(self.run_dir)
        )
        if self.rank_metrics is not None:
            self.rank_metrics.close()  # every rank's last records are written (full_state_dict synchronised)
        events.close()
        return self.summary

    def resume_command(self) -> str:
        """The shell command that resumes this run (``--run-dir`` set to its dir)."""
        return resume_command(self.resume_argv, self.run_dir or self.requested_run_dir or "RUN_DIR")

    def _already_complete(self) -> dict[str, Any]:
        """Nothing to train (the newest checkpoint reached ``train.steps``): say so; summary.json stays as it was."""
        steps, done = self.config.train.steps, self.complete_at
        assert done is not None and self.events is not None
        self.events.log(
            f"crosstrain: run {self.run_dir} is already complete at step {done} (train.steps={steps}); "
            f"nothing was trained or written. To train further raise train.steps, e.g. --set "
            f"train.steps={2 * done}"
        )
        return {"already_complete": True, "steps": done, "run_dir": str(self.run_dir)}

    def teardown(self) -> None:
        """Stop the watchers and sinks, close the checkpoints, and give back what building the run changed."""
        self.preemption.uninstall()
        if self.rank_metrics is not None:
            self.rank_metrics.close()
        if self.hang_watchdog is not None:
            self.hang_watchdog.close()
        if self.events is not None:
            self.events.close()
        try:
            if self.checkpoints is not None:
                try:
                    self.checkpoints.manager.close()
                except CheckpointError:
                    raise
                except Exception:
                    pass
        finally:
            if self.run is not None:
                self.run.close()
