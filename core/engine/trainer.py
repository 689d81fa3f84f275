"""The Trainer: builds model, data and optimizer from a :class:`~crosstrain.config.Config` and runs the loop.

It uses only core interfaces: the active backend's device and collective, kernels through the model,
parallelism through :mod:`crosstrain.parallel` and checkpoints through
:class:`crosstrain.checkpoint.manager.CheckpointManager`. Every check that can fail on a user mistake runs
before the run dir is created, so a bad config writes nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from crosstrain import pluginmanager, registry
from crosstrain.config import Config, check_world, gpt_config, resolve_import_path, save_config
from crosstrain.data import DistributedBatchSampler, build_dataset
from crosstrain.distenv import DistEnv
from crosstrain.engine.loss_scale import DynamicLossScaler
from crosstrain.engine.metrics import (
    JsonlSink,
    MetricsHub,
    PlainConsoleSink,
    RichProgressSink,
    TensorBoardSink,
    tensorboard_available,
)
from crosstrain.engine.preemption import PreemptionWatcher
from crosstrain.engine.state import agree_run_dir, params_sha256
from crosstrain.errors import CheckpointError, ConfigError, CrosstrainError, PluginError
from crosstrain.optim.factory import build_optimizer
from crosstrain.optim.schedules import build_schedule

#: below this many parameters ``train.threads = 0`` uses one host thread (op overhead dominates small models).
AUTO_SINGLE_THREAD_PARAMS = 20_000_000

#: multi-process runs agree on SIGTERM about this often (in seconds of training), measured after
#: VOTE_CALIBRATION_STEPS steps; until then they vote every step.
PREEMPT_CHECK_S = 0.5
VOTE_CALIBRATION_STEPS = 6

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(CrosstrainError):
    """Training cannot continue (e.g. non-finite loss persists and there is nothing to roll back to)."""

    exit_code = 1


class _Counters:
    """Trainer progress that is checkpointed with the model (same on every rank)."""

    def __init__(self) -> None:
        self.step = 0
        self.nonfinite_steps = 0
        self.rollbacks = 0
        self.initial_loss = float("nan")

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "nonfinite_steps": self.nonfinite_steps, "rollbacks": self.rollbacks,
                "initial_loss": self.initial_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.nonfinite_steps = int(state["nonfinite_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.initial_loss = float(state["initial_loss"])


class _DataState:
    """Data position and loss scale: the same on every rank, so saved once and restored under any layout."""

    def __init__(self, sampler: DistributedBatchSampler, scaler: DynamicLossScaler) -> None:
        self.sampler, self.scaler = sampler, scaler

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.scaler.load_state_dict(state["scaler"])


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def build_model(config: Config) -> torch.nn.Module:
    """The built-in GPT from ``model.preset`` (+ overrides), or ``model.import_path``'s callable."""
    if config.model.import_path:
        builder = resolve_import_path(config.model.import_path)
        model = builder(config.model)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model.import_path {config.model.import_path!r} returned "
                              f"{type(model).__name__}, not a torch.nn.Module")
        return model
    from crosstrain.models.gpt import GPT

    return GPT(gpt_config(config))


def _flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    fn = getattr(model, "flops_per_token", None)
    if callable(fn):
        return float(fn(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


class Trainer:
    """``Trainer(config).fit()`` trains and returns the summary (also written to ``summary.json``).

    Hooks see the trainer as ``context``: ``config``, ``run_dir``, ``step``, ``rank``, ``world_size``,
    ``model`` (this rank's module), ``parallel_model``, ``optimizer``, ``mesh``, ``dims``, ``summary`` and,
    after training, ``final_state_dict`` (full fp32 tensors with the plain GPT's names).
    """

    def __init__(self, config: Config, run_dir: str | Path | None = None) -> None:
        self.config = config
        self.requested_run_dir = run_dir
        self.run_dir: Path | None = None
        self.counters = _Counters()
        self.losses: list[float] = []
        self.summary: dict[str, Any] = {}
        self.final_state_dict: dict[str, torch.Tensor] | None = None
        self.preemption = PreemptionWatcher()
        self.checkpoints: Any = None
        self.metrics = MetricsHub()
        self._kernel_mode: str | None = None
        self._threads_before: int | None = None
        self._vote_every = 1

    # ------------------------------------------------------------------ properties hooks rely on
    @property
    def step(self) -> int:
        return self.counters.step

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world_size(self) -> int:
        return self.collective.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def model(self) -> torch.nn.Module:
        return self.parallel_model.module

    # ------------------------------------------------------------------ setup
    def _validate(self) -> None:
        """Everything a user can get wrong, checked before any process group, file or model exists."""
        cfg = self.config
        self.env = DistEnv.from_env()
        self.dims = check_world(cfg, self.env.world_size)
        if cfg.model.import_path:
            resolve_import_path(cfg.model.import_path)
        self.dataset = build_dataset(cfg.data.path, cfg.train.seq_len)
        if not cfg.model.import_path:
            vocab = gpt_config(cfg).vocab_size
            if self.dataset.vocab_size > vocab:
                raise ConfigError(f"the data's vocabulary ({self.dataset.vocab_size}) is larger than "
                                  f"model.vocab_size={vocab}; raise model.vocab_size")
        resume = cfg.checkpoint.resume
        if resume not in ("auto", "never") and not Path(resume).exists():
            raise ConfigError(f"checkpoint.resume {resume!r} does not exist; use 'auto', 'never' or a checkpoint path")
        if self.requested_run_dir is not None and Path(self.requested_run_dir).is_file():
            raise ConfigError(f"--run-dir {str(self.requested_run_dir)!r} is a file; pass a directory")

    def setup(self) -> None:
        cfg = self.config
        self.backend = registry.set_active_backend(None if cfg.backend == "auto" else cfg.backend)
        self._validate()
        from crosstrain.kernels import registry as kernel_registry

        if cfg.kernels.mode != "auto":
            self._kernel_mode = kernel_registry.mode
            kernel_registry.set_mode(cfg.kernels.mode)
        from crosstrain.parallel import build_mesh, dp_rank_and_size, parallelize

        self.device_api = self.backend.device()
        self.collective = self.backend.collective()
        self._owns_group = not self.collective.initialized
        self.collective.init(timeout=cfg.fault.collective_timeout_s)
        self.device = self.device_api.device_for_local_rank(self.env.local_rank)
        self.device_api.set_device(self.device)
        torch.manual_seed(cfg.train.seed)
        self.device_api.manual_seed(cfg.train.seed)

        model = self._transform_model(build_model(cfg))
        self._set_threads(model)
        self.flops_per_token = _flops_per_token(model, cfg.train.seq_len)
        self.model_config = getattr(model, "config", None)
        self.mesh = build_mesh(self.collective, self.dims)
        self.parallel_model = parallelize(
            model, self.dims, self.mesh, self.device, precision=cfg.precision.dtype,
            activation_checkpoint=cfg.parallel.activation_checkpoint, compile=cfg.parallel.compile,
            pp_schedule=cfg.parallel.pp_schedule, pp_microbatches=cfg.parallel.pp_microbatches,
        )
        self.params = [p for p in self.parallel_model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim, self.device)
        self.schedule = build_schedule(self.optimizer, cfg.schedule, cfg.train.steps)
        self.scaler = DynamicLossScaler(cfg.precision.dtype == "fp16", cfg.precision.init_loss_scale,
                                        cfg.precision.loss_scale_growth_interval)
        dp_rank, dp_size = dp_rank_and_size(self.mesh, self.dims)
        self.sampler = DistributedBatchSampler(
            len(self.dataset), cfg.train.batch_size, dp_rank=dp_rank, dp_size=dp_size,
            micro_batches=cfg.train.grad_accum, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
        )
        from crosstrain.checkpoint.app_state import RNGState

        self.rng_state = RNGState(self.device_api)

        self.run_dir = agree_run_dir(self.collective, self.requested_run_dir, cfg.train.output_dir)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        self._setup_checkpoints()
        self._resume()
        self._setup_metrics()
        self.preemption.install()

    def _set_threads(self, model: torch.nn.Module) -> None:
        threads = self.config.train.threads
        if threads == 0 and "OMP_NUM_THREADS" not in os.environ:
            if sum(p.numel() for p in model.parameters()) < AUTO_SINGLE_THREAD_PARAMS:
                threads = 1
        if threads:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)

    def _transform_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply each plugin's ``crosstrain_transform_model`` in registration order (a failure is fatal)."""
        for _, result in pluginmanager.call_strict("crosstrain_transform_model", "transform the model",
                                                   model=model, config=self.config):
            if result is not None:
                model = result
        return model

    def _setup_checkpoints(self) -> None:
        from crosstrain.checkpoint.app_state import has_persistent_buffers
        from crosstrain.checkpoint.manager import CheckpointManager

        cfg = self.config.checkpoint
        assert self.run_dir is not None
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=cfg.keep_last,
                                             keep_every=cfg.keep_every, async_save=cfg.async_save,
                                             collective=self.collective)
        # Async saves copy model and optimizer tensors while the next forward/backward runs, fenced before
        # the optimizer step. Modules with persistent buffers may update them in forward (BatchNorm running
        # stats), so such models are staged before save() returns instead.
        defer = cfg.async_save and not has_persistent_buffers(self.parallel_model.module)
        self._stage_later = ("app",) if defer else ()

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds: model + optimizer (resharding), schedule, counters, data position and loss
        scale, per-rank RNG (``RankLocal``) and the extras plugins return from ``crosstrain_checkpoint_state``."""
        from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal

        state: dict[str, Any] = {
            "app": ModelOptimizerState(self.parallel_model.module, self.optimizer),
            "schedule": self.schedule,
            "trainer": self.counters,
            "data": _DataState(self.sampler, self.scaler),
            "rng": RankLocal(self.rng_state),
        }
        for plugin_name, extra in pluginmanager.call_strict("crosstrain_checkpoint_state", "add checkpoint state",
                                                                 context=self):
            for key, value in (extra or {}).items():
                if key in state:
                    raise PluginError(f"plugin {plugin_name!r} checkpoint key {key!r} clashes with another key")
                state[key] = value
        return state

    def _resume(self) -> None:
        resume = self.config.checkpoint.resume
        if self.checkpoints is None or resume == "never":
            return
        target = self.checkpoints.latest_together() if resume == "auto" else resume
        if target is None:
            return
        step = self.checkpoints.load(target, self.checkpoint_state())
        self.counters.step = int(step)
        self._log(f"crosstrain: resumed from {getattr(target, 'path', target)} at step {self.counters.step}")

    def _setup_metrics(self) -> None:
        if not self.is_main:
            return
        cfg = self.config.logging
        assert self.run_dir is not None
        resumed = self.counters.step or None  # a resumed run: later records belong to rolled-back work
        self.metrics.add(JsonlSink(self.run_dir / "metrics.jsonl", resume_step=resumed))
        mode = cfg.progress
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        if mode == "rich":
            self.metrics.add(RichProgressSink(self.config.train.steps, self.counters.step))
        elif mode == "plain":
            self.metrics.add(PlainConsoleSink(self.config.train.steps, cfg.every))
        if cfg.tensorboard and tensorboard_available():
            self.metrics.add(TensorBoardSink(self.run_dir / "tensorboard", resume_step=resumed))
        for _, sinks in pluginmanager.call_each("crosstrain_metrics_sinks", config=self.config):
            for sink in sinks or []:
                self.metrics.add(sink)

    # ------------------------------------------------------------------ the loop
    def _log(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if self.device.type == "cpu" else self.device

    def _start_stop_vote(self, index: int) -> Any:
        """Start agreeing whether any rank got SIGTERM: a one-element async all-reduce overlapping the step.

        Multi-process runs vote every ``_vote_every`` steps (about every :data:`PREEMPT_CHECK_S` seconds);
        ``False`` means "no vote this step".
        """
        if self.world_size == 1:
            return None
        if index % self._vote_every:
            return False
        flag = torch.tensor([1.0 if self.preemption.requested else 0.0], device=self._comm_device())
        return flag, self.collective.all_reduce(flag, op="max", async_op=True)

    def _finish_stop_vote(self, vote: Any) -> bool:
        if vote is None:
            return self.preemption.requested
        if vote is False:
            return False
        flag, work = vote
        if work is not None:
            work.wait()
        return bool(flag.item() > 0)

    def _calibrate_vote(self, step_times: list[float]) -> None:
        """Once, on every rank at the same step: vote about every PREEMPT_CHECK_S seconds (rank 0's step time)."""
        median = torch.tensor([sorted(step_times)[len(step_times) // 2]], dtype=torch.float64,
                              device=self._comm_device())
        self.collective.broadcast(median, src=0)
        self._vote_every = max(1, int(PREEMPT_CHECK_S / max(float(median.item()), 1e-6)))

    def train_step(self) -> dict[str, float]:
        """One optimizer step (``grad_accum`` micro-batches); returns the step's metrics."""
        cfg = self.config
        pm = self.parallel_model
        t0 = time.perf_counter()
        micro = [self.dataset.batch(idx) for idx in self.sampler.next_step()]
        micro = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in micro]
        t_data = time.perf_counter() - t0
        lr = self.schedule.lr
        ga = len(micro)
        losses = []
        times: dict[str, float] = {}
        for i, (x, y) in enumerate(micro):
            if ga > 1:
                pm.set_gradient_sync(i == ga - 1)
            loss, timings = pm.forward_backward(x, y, scale=self.scaler.scale, divisor=ga)
            losses.append(loss)
            for key, value in (timings or {}).items():
                name = key if key.startswith("time_") else f"time_{key}"
                name = name if name.endswith("_s") else f"{name}_s"
                times[name] = times.get(name, 0.0) + float(value)
        loss_value = float(sum(float(v) for v in losses) / ga)
        t_opt = time.perf_counter()
        if self.checkpoints is not None:
            self.checkpoints.fence()  # an async save may still be copying parameters and optimizer state
            # A failed async save raises here, on every rank, on the step after it failed. The agreement (a small
            # collective) was started at the end of the previous step and has completed during this one's compute.
            self.checkpoints.check_background()
        next_step = self.counters.step + 1
        pluginmanager.call_strict("crosstrain_transform_gradients", "transform the gradients", model=pm.module,
                                  step=next_step, context=self)
        self.scaler.unscale_(self.params)
        grad_norm = float(pm.clip_grad_norm_(cfg.optim.grad_clip))  # 0: measure only
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(finite)
        self.device_api.synchronize()
        now = time.perf_counter()
        self.counters.step = next_step
        if finite:
            self.schedule.step()
        step_time = now - t0
        tokens = cfg.train.batch_size * cfg.train.seq_len
        metrics: dict[str, float] = {
            "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
            "tokens_per_s": tokens / step_time, "time_data_s": t_data, **times,
            "time_optimizer_s": now - t_opt,
        }
        if self.peak_flops > 0:
            metrics["mfu"] = self.flops_per_token * tokens / step_time / (self.peak_flops * self.world_size)
        metrics["peak_memory_bytes"] = float(self.device_api.memory_stats().peak)
        memory_report = getattr(self.optimizer, "memory_report", None)
        if memory_report is not None:  # optimizer-state offload: host bytes and device bytes saved
            metrics.update({k: float(v) for k, v in memory_report().items()})
        if self.scaler.enabled:
            metrics["loss_scale"] = self.scaler.scale
        if not finite:
            metrics["skipped"] = 1.0
        return metrics

    def _handle_nonfinite(self, metrics: dict[str, float], consecutive: int) -> int:
        if not metrics.get("skipped"):
            return 0
        self.counters.nonfinite_steps += 1
        consecutive += 1
        if self.scaler.enabled and self.scaler.scale > 1.0:
            return 0  # fp16 overflow: the lower loss scale is the remedy, not a rollback
        limit = self.config.fault.max_consecutive_nonfinite
        if consecutive < limit:
            return consecutive
        info = self.checkpoints.latest_together() if self.checkpoints is not None else None
        if info is None:
            raise TrainingError(
                f"loss or gradients were non-finite for {consecutive} consecutive steps (up to step {self.step}) "
                "and there is no checkpoint to roll back to; lower optim.lr or set checkpoint.every"
            )
        step, sampler_state, counters = self.step, self.sampler.state_dict(), self.counters.state_dict()
        schedule_state = self.schedule.state_dict()
        restored = self.checkpoints.load(info, self.checkpoint_state())
        self.sampler.load_state_dict(sampler_state)  # keep going on new data past the bad batches
        self.counters.load_state_dict(counters)
        self.counters.rollbacks += 1
        self.schedule.load_state_dict(schedule_state)
        self._log(f"crosstrain: {consecutive} non-finite steps in a row at step {step}; "
                  f"rolled back model and optimizer to the checkpoint of step {restored}")
        return 0

    def _save(self, step: int) -> None:
        if self.checkpoints is None:
            return
        self.checkpoints.save(step, self.checkpoint_state(), stage_later=self._stage_later)  # waits for the last

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or until SIGTERM) and return the summary."""
        start = time.perf_counter()
        try:
            self.setup()
            return self._fit(start)
        finally:
            self.teardown()

    def _fit(self, start: float) -> dict[str, Any]:
        cfg = self.config
        self.peak_flops = float(self.device_api.peak_flops(_DTYPES[cfg.precision.dtype]) or 0.0)
        self.device_api.reset_peak_memory_stats()
        every = cfg.checkpoint.every
        consecutive = 0
        step_times: list[float] = []
        first_step = self.counters.step
        last_saved = first_step if first_step else -1
        preempted = False
        loop_start = time.perf_counter()
        on_step_end = bool(pluginmanager.plugin_manager().hook.crosstrain_on_step_end.get_hookimpls())
        while self.counters.step < cfg.train.steps:
            index = self.counters.step - first_step
            if index == VOTE_CALIBRATION_STEPS and self.world_size > 1:
                self._calibrate_vote(step_times[1:])
            vote = self._start_stop_vote(index)
            metrics = self.train_step()
            step = self.counters.step
            if step == 1 or not math.isfinite(self.counters.initial_loss):
                if math.isfinite(metrics["loss"]):
                    self.counters.initial_loss = metrics["loss"]
            self.losses.append(metrics["loss"])
            step_times.append(metrics["step_time_s"])
            consecutive = self._handle_nonfinite(metrics, consecutive)
            if on_step_end:
                pluginmanager.call_each("crosstrain_on_step_end", context=self, step=step, metrics=metrics)
            self.metrics.write(step, metrics)
            if every and step % every == 0:
                self._save(step)
                last_saved = step
            if self.checkpoints is not None:
                self.checkpoints.start_check()  # finished by check_background() in the next step, without waiting
            if self._finish_stop_vote(vote):
                preempted = True
                break
        loop_time = time.perf_counter() - loop_start
        step = self.counters.step
        if self.checkpoints is not None and last_saved != step and (every or preempted):
            self._save(step)
        if self.checkpoints is not None:
            self.checkpoints.wait()
            self.checkpoints.check_background()
        self.final_state_dict = self.parallel_model.full_state_dict()
        steps_run = step - first_step
        tokens_per_s = steps_run * cfg.train.batch_size * cfg.train.seq_len / loop_time if steps_run else 0.0
        mfu = (self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)) if self.peak_flops else 0.0
        finite_losses = [v for v in self.losses if math.isfinite(v)]
        self.summary = {
            "backend": self.backend.name,
            "world_size": self.world_size,
            "mesh": self.dims.mesh_shape(),
            "steps": step,
            "steps_this_run": steps_run,
            "initial_loss": self.counters.initial_loss,
            "final_loss": finite_losses[-1] if finite_losses else float("nan"),
            "losses": self.losses,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_memory_bytes": int(self.device_api.memory_stats().peak),
            "median_step_time_s": sorted(step_times)[len(step_times) // 2] if step_times else 0.0,
            "wall_s": time.perf_counter() - start,
            "params_sha256": params_sha256(self.final_state_dict),
            "nonfinite_steps": self.counters.nonfinite_steps,
            "rollbacks": self.counters.rollbacks,
            "preempted": preempted,
            "run_dir": str(self.run_dir),
            "precision": cfg.precision.dtype,
        }
        if self.is_main:
            assert self.run_dir is not None
            text = json.dumps(_finite_or_none(self.summary), indent=2, default=str)
            (self.run_dir / "summary.json").write_text(text + "\n")
        self.metrics.close()
        if preempted:
            where = f"saved a checkpoint in {self.run_dir}/checkpoints" if self.checkpoints else "no checkpoint"
            self._log(f"crosstrain: {self.preemption.signal_name or 'SIGTERM'} received; finished step {step}, "
                      f"{where}; exiting. Resume with: crosstrain train ... --run-dir {self.run_dir}")
        pluginmanager.call_strict("crosstrain_after_train", "finish after training", context=self,
                                  run_dir=str(self.run_dir))
        return self.summary

    def teardown(self) -> None:
        self.preemption.uninstall()
        self.metrics.close()
        if self.checkpoints is not None:
            try:
                self.checkpoints.close()
            except CheckpointError:
                raise
            except Exception:
                pass
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        if self._kernel_mode is not None:
            from crosstrain.kernels import registry as kernel_registry

            kernel_registry.set_mode(self._kernel_mode)
        collective = getattr(self, "collective", None)
        if collective is not None and getattr(self, "_owns_group", False):
            collective.destroy()
