"""The training loop: builds a recipe's models, data and optimizers from a :class:`~crosstrain.config.Config`
and runs the steps with every guarantee the loop owns.

The loop owns counters, gradient accumulation, clipping, mixed precision and fp16 loss scaling, the async
checkpoint fence and background check, the preemption vote, the non-finite skip and rollback, metrics,
resume and teardown; the recipe (:mod:`crosstrain.engine.recipe`, ``lm`` by default) owns what is trained.
It uses only core interfaces: the active backend's device and collective, kernels through the model,
parallelism through :mod:`crosstrain.parallel` and checkpoints through
:class:`crosstrain.checkpoint.manager.CheckpointManager`. Every check that can fail on a user mistake runs
before the run dir is created, so a bad config writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from crosstrain import pluginmanager, registry
from crosstrain.checkpoint.manifest import atomic_write
from crosstrain.config import Config, check_world, save_config
from crosstrain.data import DistributedBatchSampler
from crosstrain.distenv import DistEnv
from crosstrain.engine import fast_defaults
from crosstrain.engine import step as stepmod
from crosstrain.engine.capabilities import check_capabilities
from crosstrain.engine.context import RunContext
from crosstrain.engine.counters import Counters, DataState
from crosstrain.engine.evaluate import check_eval, eval_batches, evaluate
from crosstrain.engine.flops import count_flops, training_flops_per_token
from crosstrain.engine.loss_scale import DynamicLossScaler
from crosstrain.engine.metrics import (
    EventsFileSink,
    JsonlSink,
    MetricsHub,
    PlainConsoleSink,
    RichProgressSink,
    SinkInfo,
    TensorBoardSink,
    tensorboard_available,
)
from crosstrain.engine.models import FrozenRecord, TrainedModel, check_specs, frozen_sha256, transform_specs
from crosstrain.engine.preemption import PreemptionWatcher, StopVote
from crosstrain.engine.ranks import RankMetrics
from crosstrain.engine.recipe import Recipe, resolve_recipe
from crosstrain.engine.state import agree_run_dir, params_sha256
from crosstrain.engine.watchdog import HangWatchdog, check_hang_dump
from crosstrain.errors import CheckpointError, ConfigError, CrosstrainError, PluginError
from crosstrain.optim.factory import build_optimizer
from crosstrain.optim.schedules import build_schedule
from crosstrain.runlock import RunDirLock, lock_together

#: below this many parameters ``train.threads = 0`` uses one host thread (op overhead dominates small models).
AUTO_SINGLE_THREAD_PARAMS = 20_000_000

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(CrosstrainError):
    """Training cannot continue (e.g. non-finite loss persists and there is nothing to roll back to)."""

    exit_code = 1


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


class Trainer:
    """``Trainer(config).fit()`` trains and returns the summary (also written to ``summary.json``).

    Hooks receive :attr:`context`, a :class:`~crosstrain.engine.context.RunContext`, never the Trainer.
    """

    def __init__(self, config: Config, run_dir: str | Path | None = None, recipe: Recipe | None = None) -> None:
        self.config = config
        self._given_recipe = recipe  # a recipe instance (e.g. the FL client's); None: train.recipe by name
        self.requested_run_dir = run_dir
        self.run_dir: Path | None = None
        self.counters = Counters()
        self.losses: list[float] = []
        self.summary: dict[str, Any] = {}
        self.final_state_dict: dict[str, torch.Tensor] | None = None
        self.preemption = PreemptionWatcher()
        self.checkpoints: Any = None
        self.metrics = MetricsHub()
        self.models: dict[str, TrainedModel] = {}
        self.context: RunContext | None = None
        self._kernel_mode: str | None = None
        self._threads_before: int | None = None
        self._early_events: list[tuple[int, str, dict[str, Any]]] = []
        self.rank_metrics: RankMetrics | None = None
        self.hang_watchdog: HangWatchdog | None = None
        self._run_lock: RunDirLock | None = None
        self.complete_at: int | None = None  # the newest checkpoint already reached train.steps
        self._rollbacks_this_run = 0
        self._protected = False
        self.eval_dataset: Any = None
        self.eval_only = False  # crosstrain eval: build the eval data whatever eval.every says
        self.last_eval_loss = float("nan")

    # ------------------------------------------------------------------ what hooks and tests read
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
    def primary(self) -> TrainedModel:
        """The first trainable model: summary.json's ``params_sha256`` and ``final_state_dict`` describe it."""
        return next(m for m in self.models.values() if m.trainable)

    @property
    def parallel_model(self) -> Any:
        return self.primary.parallel

    @property
    def model(self) -> torch.nn.Module:
        return self.primary.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.primary.optimizer is not None
        return self.primary.optimizer

    @property
    def trainable(self) -> list[TrainedModel]:
        return [m for m in self.models.values() if m.trainable]

    # ------------------------------------------------------------------ setup
    def _validate(self) -> None:
        """Everything a user can get wrong, checked before any process group, file or model exists."""
        cfg = self.config
        check_capabilities(self.backend, cfg)
        check_hang_dump(cfg)
        self.env = DistEnv.from_env()
        self.dims = check_world(cfg, self.env.world_size, self._memory_per_rank())
        self.recipe: Recipe = self._given_recipe or resolve_recipe(cfg.train.recipe)
        self.recipe.validate(cfg)
        resume = cfg.checkpoint.resume
        if resume not in ("auto", "never") and not Path(resume).exists():
            raise ConfigError(f"checkpoint.resume {resume!r} does not exist; use 'auto', 'never' or a checkpoint path")
        if self.requested_run_dir is not None and Path(self.requested_run_dir).is_file():
            raise ConfigError(f"--run-dir {str(self.requested_run_dir)!r} is a file; pass a directory")

    def _memory_per_rank(self) -> int:
        """The device memory one rank may use (ranks sharing a device, or the host, split it); 0 if unknown."""
        device_api = self.backend.device()
        sharing = max(1, -(-self.env.local_world_size // max(device_api.device_count(), 1)))
        return int(device_api.memory_stats().total) // sharing

    def setup(self) -> None:
        cfg = self.config
        self.setup_models()
        from crosstrain.parallel import dp_rank_and_size

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
        self._run_lock = lock_together(self.collective, self.run_dir)  # creates it; one job per run dir
        assert self.context is not None
        self.context.run_dir = self.run_dir
        self._setup_checkpoints()
        self._resume()
        if self.complete_at is not None:
            return  # nothing to train: the run dir stays exactly as it is
        self.context.resume_step = self.counters.step
        self._setup_metrics()
        if self.is_main:  # only now: a rejected resume or a busy metrics port must leave the run's config as it was
            save_config(cfg, self.run_dir)
        self.rank_metrics = RankMetrics.for_run(cfg, self.run_dir, self.rank, self.world_size, self._emit,
                                                self.counters.step)
        self.hang_watchdog = HangWatchdog.for_run(cfg, self.run_dir, self.rank, self._emit, self.counters.step)
        self.preemption.install()
        self.stop_vote = StopVote(self.collective, self.preemption, self.device)

    def setup_models(self) -> None:
        """Backend, process group, mesh, the recipe's parallelised models and its datasets; no file is written
        (``crosstrain eval`` stops here and loads a checkpoint's weights)."""
        cfg = self.config
        self.backend = registry.set_active_backend(None if cfg.backend == "auto" else cfg.backend)
        self._validate()
        from crosstrain.kernels import registry as kernel_registry

        if cfg.kernels.mode != "auto":
            self._kernel_mode = kernel_registry.mode
            kernel_registry.set_mode(cfg.kernels.mode)
        from crosstrain.parallel import build_mesh

        self.device_api = self.backend.device()
        self.collective = self.backend.collective()
        self._owns_group = not self.collective.initialized
        self.collective.init(timeout=cfg.fault.collective_timeout_s)
        self.device = self.device_api.device_for_local_rank(self.env.local_rank)
        self.device_api.set_device(self.device)
        torch.manual_seed(cfg.train.seed)
        self.device_api.manual_seed(cfg.train.seed)
        self.mesh = build_mesh(self.collective, self.dims)
        self.context = RunContext(
            config=cfg, recipe=self.recipe.name, rank=self.rank, world_size=self.world_size,
            local_rank=self.env.local_rank, dims=self.dims, mesh=self.mesh, device=self.device,
            backend=self.backend.name, _step=lambda: self.counters.step, _emit=self._emit, _stop=self._request_stop,
        )
        self._build_models()
        self.dataset = self.recipe.build_dataset(self.context)
        self._setup_eval()

    def _build_models(self) -> None:
        """The recipe's models, transformed by plugins, parallelised, with an optimizer each if trainable."""
        from crosstrain.parallel import parallelize

        cfg = self.config
        assert self.context is not None
        specs = self.recipe.build_models(self.context)
        check_specs(specs, self.recipe, self.dims.pp)
        built = transform_specs(specs, cfg)
        self._set_threads(list(built.values()))
        trainable_built = [built[n] for n, spec in specs.items() if spec.trainable]
        self.compile_choice = self._decide_compile(trainable_built[0] if trainable_built else None)
        for name, spec in specs.items():
            module = built[name]
            sha = "" if spec.trainable else frozen_sha256(module)
            pm = parallelize(
                module, self.dims, self.mesh, self.device, precision=cfg.precision.dtype,
                activation_checkpoint=cfg.parallel.activation_checkpoint if spec.trainable else "none",
                compile=self.compile_choice.enabled and spec.trainable, pp_schedule=cfg.parallel.pp_schedule,
                pp_microbatches=cfg.parallel.pp_microbatches, trainable=spec.trainable,
                loss_fn=self.recipe.pipeline_loss if self.dims.pp > 1 else None,
            )
            slot = TrainedModel(name, pm, spec.trainable, spec.source or f"recipe {self.recipe.name}", sha)
            if spec.trainable:
                slot.optimizer = build_optimizer(slot.params, cfg.optim, self.device, backend=self.backend)
                slot.schedule = build_schedule(slot.optimizer, cfg.schedule, cfg.train.steps)
            self.models[name] = slot
        primary = self.primary.module
        self.flops_per_token, self.mfu_flops = count_flops(  # every model's FLOPs, frozen ones forward only
            ((n, m.module, m.trainable) for n, m in self.models.items()), cfg.train.seq_len)
        self.model_config = getattr(primary, "config", None)
        self.params = [p for m in self.trainable for p in m.params]
        ctx = self.context
        ctx.models = {n: m.module for n, m in self.models.items()}
        ctx.parallel_models = {n: m.parallel for n, m in self.models.items()}
        ctx.optimizers = {n: m.optimizer for n, m in self.models.items() if m.optimizer is not None}
        ctx.model_config = self.model_config

    def _decide_compile(self, module: torch.nn.Module | None) -> fast_defaults.CompileChoice:
        """``parallel.compile`` resolved for the primary model (see :mod:`crosstrain.engine.fast_defaults`)."""
        from crosstrain.parallel.plan import find_plan

        cfg = self.config
        requested = cfg.parallel.compile
        if module is None:
            return fast_defaults.CompileChoice(False, "no trainable model")
        if self.eval_only and requested == "auto":
            return fast_defaults.CompileChoice(False, "crosstrain eval: no training steps to amortise a compile")
        micro = max(cfg.train.batch_size // max(self.dims.dp_degree, 1) // cfg.train.grad_accum, 1)
        key = fast_defaults.model_key(module, self.dims, cfg.precision.dtype, micro, cfg.train.seq_len)
        est_step_s = 0.0
        if requested == "auto":
            peak = float(self.device_api.peak_flops(_DTYPES[cfg.precision.dtype]) or 0.0)
            work = training_flops_per_token(module, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
            est_step_s = work / self.world_size / (peak * fast_defaults.EAGER_MFU) if peak > 0 else 0.0
        choice = fast_defaults.decide_compile(requested, self.dims, find_plan(module, "ac_units") is not None,
                                              cfg.train.steps, est_step_s, key)
        if choice.enabled:
            fast_defaults.enable_compile_caches()
        return choice

    def _defaults_report(self) -> dict[str, Any]:
        """What the fast defaults chose and why (summary.json ``defaults``; ``crosstrain train -v``)."""
        layout = self.dims.layout_choice
        return {
            "optimizer": {"impl": getattr(self.optimizer, "crosstrain_impl", "custom"),
                          "class": type(self.optimizer).__name__, "requested": self.config.optim.impl},
            "kernels": {"mode": self.config.kernels.mode, **fast_defaults.kernel_choices(self.device.type)},
            "compile": {"enabled": self.compile_choice.enabled, "reason": self.compile_choice.reason},
            "layout": {"choice": layout.layout if layout else ("fsdp" if self.dims.fsdp_enabled else "ddp"),
                       "reason": layout.reason if layout else "", "requested": self.config.parallel.layout},
        }

    def _log_defaults(self, report: dict[str, Any]) -> None:
        if not (self.is_main and logging.getLogger("crosstrain").isEnabledFor(logging.INFO)):
            return
        kernels = ", ".join(f"{op}={impl}" for op, impl in report["kernels"].items() if op != "mode")
        opt, comp, lay = report["optimizer"], report["compile"], report["layout"]
        self._log(f"crosstrain: optimizer {opt['class']} (optim.impl={opt['requested']} -> {opt['impl']}); "
                  f"kernels ({report['kernels']['mode']}): {kernels}; compile "
                  f"{'on' if comp['enabled'] else 'off'} ({comp['reason']}); layout {lay['choice']} ({lay['reason']})")

    def _setup_eval(self) -> None:
        """The recipe's held-out samples, checked against the eval batch size and layout (before any file)."""
        from crosstrain.parallel import dp_rank_and_size

        cfg = self.config.eval
        assert self.context is not None
        wanted = cfg.every or self.eval_only
        self.eval_dataset = self.recipe.build_eval_dataset(self.context) if wanted else None
        self.eval_batch_size = cfg.batch_size or self.config.train.batch_size
        self.dp_rank, self.dp_size = dp_rank_and_size(self.mesh, self.dims)
        self.eval_batches = 0
        if self.eval_dataset is not None:
            check_eval(len(self.eval_dataset), self.eval_batch_size, self.dp_size, self.parallel_model.microbatches)
            self.eval_batches = eval_batches(len(self.eval_dataset), self.eval_batch_size, cfg.steps)

    def _eval_due(self, step: int) -> bool:
        cfg = self.config
        if self.eval_dataset is None or not cfg.eval.every:
            return False
        saving = bool(cfg.checkpoint.every) and step % cfg.checkpoint.every == 0
        return step % cfg.eval.every == 0 or step == cfg.train.steps or (cfg.checkpoint.keep_best and saving)

    def evaluate(self) -> dict[str, float]:
        """Evaluate the models on the recipe's held-out samples now (every rank; see crosstrain.engine.evaluate)."""
        assert self.eval_dataset is not None
        return evaluate(self.recipe, self.models, self.primary, self.eval_dataset, batch_size=self.eval_batch_size,
                        steps=self.config.eval.steps, dp_rank=self.dp_rank, dp_size=self.dp_size, device=self.device)

    def _set_threads(self, models: list[torch.nn.Module]) -> None:
        threads = self.config.train.threads
        if threads == 0 and "OMP_NUM_THREADS" not in os.environ:
            if sum(p.numel() for m in models for p in m.parameters()) < AUTO_SINGLE_THREAD_PARAMS:
                threads = 1
        if threads:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)

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
        primary = self.primary
        defer = cfg.async_save and not any(has_persistent_buffers(m.module) for m in self.trainable)
        self._stage_later = tuple(m.checkpoint_key(m is primary) for m in self.trainable) if defer else ()

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds: each trainable model + its optimizer (resharding) and schedule, the frozen
        models' record, counters, data position and loss scale, per-rank RNG (``RankLocal``) and the recipe's
        state."""
        from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal

        primary = self.primary
        state: dict[str, Any] = {}
        for m in self.trainable:
            key = m.checkpoint_key(m is primary)
            state[key] = ModelOptimizerState(m.module, m.optimizer)
            state["schedule" if m is primary else f"schedule_{m.name}"] = m.schedule
        if len(self.trainable) != len(self.models):
            state["frozen"] = FrozenRecord(self.models)
        state.update({"trainer": self.counters, "data": DataState(self.sampler, self.scaler),
                      "rng": RankLocal(self.rng_state)})
        for key, value in (self.recipe.state() or {}).items():
            if key in state:
                raise PluginError(f"recipe {self.recipe.name!r} checkpoint key {key!r} clashes with another key")
            state[key] = value
        return state

    def _resume(self) -> None:
        resume = self.config.checkpoint.resume
        if self.checkpoints is None or resume == "never":
            return
        from crosstrain.checkpoint.manager import resolve

        target = self.checkpoints.latest_together() if resume == "auto" else resolve(resume)
        if target is None:
            return
        if target.step >= self.config.train.steps:
            self.complete_at = target.step
            return
        step = self.checkpoints.load(target, self.checkpoint_state())
        self.counters.step = int(step)
        self._emit(self.counters.step, "resume", {
            "message": f"crosstrain: resumed from {getattr(target, 'path', target)} at step {self.counters.step}",
            "checkpoint": str(getattr(target, "path", target))})

    def _setup_metrics(self) -> None:
        if not self.is_main:
            return
        cfg = self.config.logging
        assert self.run_dir is not None
        # plugin sinks first: one that cannot start (a Prometheus port in use) stops the run before any file changes
        plugin_sinks = [sink for _, sinks in pluginmanager.call_each("crosstrain_metrics_sinks", config=self.config)
                        for sink in sinks or []]
        resumed = self.counters.step or None  # a resumed run: later records belong to rolled-back work
        # a fresh start (step 0) drops the records of an attempt killed before its first checkpoint too
        self.metrics.add(JsonlSink(self.run_dir / "metrics.jsonl", resume_step=self.counters.step))
        self.metrics.add(EventsFileSink(self.run_dir / "events.jsonl"))
        split = self.recipe.data_split()
        if split:  # how the data was split into training and held-out parts
            atomic_write(self.run_dir / "data_split.json", (json.dumps(split, indent=2) + "\n").encode())
        mode = cfg.progress
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        if mode == "rich":
            self.metrics.add(RichProgressSink(self.config.train.steps, self.counters.step))
        elif mode == "plain":
            self.metrics.add(PlainConsoleSink(self.config.train.steps, cfg.every))
        if cfg.tensorboard and tensorboard_available():
            self.metrics.add(TensorBoardSink(self.run_dir / "tensorboard", resume_step=resumed))
        for sink in plugin_sinks:
            self.metrics.add(sink)
        self.metrics.open(SinkInfo(run_dir=self.run_dir, rank=self.rank, world_size=self.world_size,
                                   resume_step=self.counters.step))
        for step, name, fields in self._early_events:
            self.metrics.event(step, name, fields)

    # ------------------------------------------------------------------ events
    def _emit(self, step: int, name: str, fields: dict[str, Any]) -> None:
        """An event to every sink (kept until the sinks exist, e.g. the resume) and its message to stderr."""
        if getattr(self, "collective", None) is None:
            return  # failed before the process group existed: the CLI prints the error itself
        message = fields.get("message")
        if message:
            self._log(str(message))
        if not self.is_main:
            return
        if self.metrics.opened:
            self.metrics.event(step, name, fields)
        else:
            self._early_events.append((step, name, fields))

    def _plugin_error(self, plugin: str, exc: BaseException) -> None:
        self._emit(self.counters.step, "plugin_error", {
            "message": f"crosstrain: warning: plugin {plugin!r} failed and was skipped: {type(exc).__name__}: {exc}",
            "plugin": plugin, "error": f"{type(exc).__name__}: {exc}", "fatal": False})

    def _request_stop(self, reason: str) -> None:
        self.preemption.requested = True
        self.preemption.signal_name = self.preemption.signal_name or reason

    # ------------------------------------------------------------------ the loop
    def _log(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def train_step(self) -> dict[str, float]:
        """One optimizer step (``grad_accum`` micro-batches); returns the step's metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        micro = [stepmod.to_device(self.dataset.batch(idx), self.device) for idx in self.sampler.next_step()]
        micro = self.recipe.prepare_step(micro, self.context)
        t_data = time.perf_counter() - t0
        primary = self.primary
        lr = primary.schedule.lr
        ga = len(micro)
        losses = []
        sums: dict[str, torch.Tensor] = {}
        times: dict[str, float] = {}
        for i, batch in enumerate(micro):
            if ga > 1:
                for m in self.trainable:
                    m.parallel.set_gradient_sync(i == ga - 1)
            loss, extra, timings = stepmod.forward_backward(self.recipe, self.models, primary, batch,
                                                            scale=self.scaler.scale, divisor=ga)
            losses.append(loss)
            for key, value in extra.items():
                sums[key] = sums[key] + value if key in sums else value
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
        for m in self.trainable:  # every optimizer and clipping see gradients laid out as their params
            m.parallel.align_grads_()
        self.scaler.unscale_(self.params)
        grad_norms = {m.name: float(m.parallel.clip_grad_norm_(cfg.optim.grad_clip)) for m in self.trainable}
        grad_norm = grad_norms[primary.name]  # 0: measure only
        finite = math.isfinite(loss_value) and all(math.isfinite(g) for g in grad_norms.values())
        for m in self.trainable:
            assert m.optimizer is not None
            if finite:
                m.optimizer.step()
            m.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(finite)
        self.device_api.synchronize()
        now = time.perf_counter()
        self.counters.step = next_step
        if finite:
            for m in self.trainable:
                m.schedule.step()
        self.recipe.after_optimizer_step(self.context, next_step)
        pluginmanager.call_strict("crosstrain_after_optimizer_step", "act after the optimizer step",
                                  context=self.context, step=next_step)
        step_time = now - t0
        tokens = cfg.train.batch_size * cfg.train.seq_len
        metrics: dict[str, float] = {
            "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
            "tokens_per_s": tokens / step_time, "time_data_s": t_data, **times,
            "time_optimizer_s": now - t_opt,
        }
        metrics.update({f"grad_norm/{n}": g for n, g in grad_norms.items() if n != primary.name})
        if sums:
            names = list(sums)
            values = (torch.stack([sums[n] for n in names]) / ga).tolist()  # one host sync for all of them
            metrics.update(dict(zip(names, values, strict=True)))
        if self.peak_flops > 0:
            metrics["mfu"] = self.flops_per_token * tokens / step_time / (self.peak_flops * self.world_size)
        metrics["peak_memory_bytes"] = float(self.device_api.memory_stats().peak)
        for m in self.trainable:
            memory_report = getattr(m.optimizer, "memory_report", None)
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
        if self.checkpoints is not None and not self._protected:
            self._protected = True  # the newest checkpoint before the first streak outlives retention (keep_last)
            self.checkpoints.protect_newest()
        limit = self.config.fault.max_consecutive_nonfinite
        if consecutive < limit:
            return consecutive
        info = self.checkpoints.latest_together() if self.checkpoints is not None else None
        if info is None:
            every = self.config.checkpoint.every
            # checkpoints are on but none was reached yet: the lr, not the checkpoint setting, is what to change
            fix = (f"lower optim.lr (now {self.config.optim.lr:g}); it diverged before the first checkpoint "
                   f"(checkpoint.every={every})") if every else "lower optim.lr or set checkpoint.every"
            raise TrainingError(
                f"loss or gradients were non-finite for {consecutive} consecutive steps (up to step {self.step}) "
                f"and there is no checkpoint to roll back to; {fix}"
            )
        if self._rollbacks_this_run >= self.config.fault.max_rollbacks:
            raise TrainingError(
                f"loss or gradients non-finite again at step {self.step} after {self._rollbacks_this_run} rollback(s) "
                f"(fault.max_rollbacks={self.config.fault.max_rollbacks}): training diverges; lower optim.lr "
                f"(now {self.config.optim.lr:g}) and resume from {info.path}")
        self._rollbacks_this_run += 1
        step, sampler_state, counters = self.step, self.sampler.state_dict(), self.counters.state_dict()
        schedules = {m.name: m.schedule.state_dict() for m in self.trainable}
        restored = self.checkpoints.load(info, self.checkpoint_state())
        self.sampler.load_state_dict(sampler_state)  # keep going on new data past the bad batches
        self.counters.load_state_dict(counters)
        self.counters.rollbacks += 1
        for m in self.trainable:
            m.schedule.load_state_dict(schedules[m.name])
        self._emit(step, "rollback", {
            "message": f"crosstrain: {consecutive} non-finite steps in a row at step {step}; "
                       f"rolled back model and optimizer to the checkpoint of step {restored}",
            "to_step": int(restored), "nonfinite_in_a_row": consecutive})
        return 0

    def _save(self, step: int, best: bool = False) -> None:
        """Save a checkpoint of ``step``; ``best``: it holds the best eval loss so far (``checkpoint.keep_best``
        keeps it, and ``crosstrain export|generate|eval RUN --best`` find it)."""
        if self.checkpoints is None:
            return
        best = best and self.config.checkpoint.keep_best
        t0 = time.perf_counter()
        self.checkpoints.save(step, self.checkpoint_state(), stage_later=self._stage_later,  # waits for the last
                              best=best)
        # duration_s: how long the loop was held (an async save writes on after it)
        self._emit(step, "checkpoint", {"committed": not self.config.checkpoint.async_save,
                                        "duration_s": time.perf_counter() - t0})

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or until SIGTERM) and return the summary."""
        start = time.perf_counter()
        try:
            self.setup()
            if self.complete_at is not None:
                return self._already_complete()
            return self._fit(start)
        except PluginError as exc:  # a strict hook stopped the run: the sinks see why before they close
            self._emit(self.counters.step, "plugin_error", {"error": str(exc), "fatal": True})
            raise
        finally:
            try:
                self.teardown()
            finally:
                if self._run_lock is not None:
                    self._run_lock.release()  # last: an in-flight save still writes into the run dir

    def _fit(self, start: float) -> dict[str, Any]:
        cfg = self.config
        self.dtype = _DTYPES[cfg.precision.dtype]
        self.peak_flops = float(self.device_api.peak_flops(self.dtype) or 0.0)
        self.device_api.reset_peak_memory_stats()
        defaults = self._defaults_report()
        self._log_defaults(defaults)
        every = cfg.checkpoint.every
        consecutive = 0
        step_times: list[float] = []
        first_step = self.counters.step
        last_saved = first_step if first_step else -1
        preempted = False
        loop_start = time.perf_counter()
        eval_time = 0.0
        on_step_end = bool(pluginmanager.plugin_manager().hook.crosstrain_on_step_end.get_hookimpls())
        # a recipe with eval_at_start (e.g. rlhf's) is also evaluated before its first step: eval_before/eval_after
        eval_record = self.recipe.eval_at_start and self.eval_dataset is not None
        eval_before = eval_after = None
        if eval_record and first_step == 0:
            eval_before = self.evaluate()
            eval_time += eval_before.get("time_eval_s", 0.0)
        while self.counters.step < cfg.train.steps:
            vote = self.stop_vote.start(self.counters.step - first_step, step_times)
            metrics = self.train_step()
            step = self.counters.step
            if step == 1 or not math.isfinite(self.counters.initial_loss):
                if math.isfinite(metrics["loss"]):
                    self.counters.initial_loss = metrics["loss"]
            self.losses.append(metrics["loss"])
            step_times.append(metrics["step_time_s"])
            consecutive = self._handle_nonfinite(metrics, consecutive)
            best = False
            if self._eval_due(step):
                results = self.evaluate()
                metrics.update(results)
                eval_time += results.get("time_eval_s", 0.0)
                self.last_eval_loss = results.get("eval/loss", float("nan"))
                best = self.counters.record_eval(step, self.last_eval_loss)
                eval_after = results
            if on_step_end:
                pluginmanager.call_each("crosstrain_on_step_end", context=self.context, step=step, metrics=metrics,
                                        on_error=self._plugin_error)
            if self.rank_metrics is not None:  # every rank, its own file: no collective (crosstrain.engine.ranks)
                self.rank_metrics.step_end(step, metrics)
            if self.hang_watchdog is not None:
                self.hang_watchdog.beat(step)
            self.metrics.write(step, metrics)
            if every and step % every == 0 and not consecutive:  # never a checkpoint of a diverging model
                self._save(step, best=best)
                last_saved = step
            if self.checkpoints is not None:
                self.checkpoints.start_check()  # finished by check_background() in the next step, without waiting
            if self.stop_vote.finish(vote):
                preempted = True
                break
        loop_time = time.perf_counter() - loop_start - eval_time  # tokens/s measures training alone
        step = self.counters.step
        if preempted:
            self._emit(step, "preemption", {"signal": self.preemption.signal_name or "SIGTERM"})
        # checkpoint.final: every finished run keeps what it trained; a preempted one always saves, to resume
        if self.checkpoints is not None and last_saved != step and (preempted or cfg.checkpoint.final):
            self._save(step, best=self.counters.best_eval_step == step)  # the last eval may be the best
        if self.checkpoints is not None:
            self.checkpoints.wait()
            self.checkpoints.check_background()
        self.final_state_dict = self.parallel_model.full_state_dict()
        steps_run = step - first_step
        tokens_per_s = steps_run * cfg.train.batch_size * cfg.train.seq_len / loop_time if steps_run else 0.0
        mfu = (self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)) if self.peak_flops else 0.0
        finite_losses = [v for v in self.losses if math.isfinite(v)]
        compile_s = 0.0
        if self.compile_choice.enabled and step_times:  # compiling happens in the first step's forward/backward
            rest = sorted(step_times[1:])
            compile_s = max(step_times[0] - (rest[len(rest) // 2] if rest else 0.0), 0.0)
            if self.is_main:
                fast_defaults.write_record(self.compile_choice.key, compile_s)
        defaults["compile"]["compile_s"] = compile_s
        self.summary = {
            "backend": self.backend.name,
            "recipe": self.recipe.name,
            "world_size": self.world_size,
            "mesh": self.dims.mesh_shape(),
            "steps": step,
            "steps_this_run": steps_run,
            "initial_loss": self.counters.initial_loss,
            "final_loss": finite_losses[-1] if finite_losses else float("nan"),
            "losses": self.losses,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "mfu_flops": self.mfu_flops,
            "peak_memory_bytes": int(self.device_api.memory_stats().peak),
            "median_step_time_s": sorted(step_times)[len(step_times) // 2] if step_times else 0.0,
            "wall_s": time.perf_counter() - start,
            "params_sha256": params_sha256(self.final_state_dict),
            "nonfinite_steps": self.counters.nonfinite_steps,
            "rollbacks": self.counters.rollbacks,
            "preempted": preempted,
            "run_dir": str(self.run_dir),
            "precision": cfg.precision.dtype,
            "peak_flops": {"flops": self.peak_flops, "source": self.device_api.peak_flops_source(self.dtype)},
            "eval_loss": self.last_eval_loss,
            "best_eval_loss": self.counters.best_eval_loss,
            "best_eval_step": self.counters.best_eval_step,
            "optim_impl": defaults["optimizer"]["impl"],
            "compile_s": compile_s,
            "defaults": defaults,
        }
        if len(self.models) > 1:
            self.summary["models"] = self._models_summary()
        if eval_record:  # {"loss": ..., "<metric>": ...}; eval_before is null on a resumed run
            for key, found in (("eval_before", eval_before), ("eval_after", eval_after)):
                self.summary[key] = {k[len("eval/"):]: v for k, v in (found or {}).items() if k.startswith("eval/")} \
                    if found else None
        self.summary.update(self.recipe.summary())
        assert self.context is not None
        self.context.summary = self.summary
        self.context.final_state_dict = self.final_state_dict
        if self.is_main:
            assert self.run_dir is not None
            text = json.dumps(_finite_or_none(self.summary), indent=2, default=str)
            (self.run_dir / "summary.json").write_text(text + "\n")
        if preempted:
            where = f"saved a checkpoint in {self.run_dir}/checkpoints" if self.checkpoints else "no checkpoint"
            self._log(f"crosstrain: {self.preemption.signal_name or 'SIGTERM'} received; finished step {step}, "
                      f"{where}; exiting. Resume with: crosstrain train ... --run-dir {self.run_dir}")
        if consecutive or (self.losses and not math.isfinite(self.losses[-1])):  # never "done" on a diverged run
            raise TrainingError(f"training ended at step {step} with a non-finite loss or gradients "
                                f"({consecutive or 1} step(s) in a row skipped); lower optim.lr (now "
                                f"{cfg.optim.lr:g}) and resume from {self.run_dir}")
        pluginmanager.call_strict("crosstrain_after_train", "finish after training", context=self.context,
                                  run_dir=str(self.run_dir))
        if self.rank_metrics is not None:
            self.rank_metrics.close()  # every rank's last records are written (full_state_dict synchronised)
        self.metrics.close()
        return self.summary

    def _already_complete(self) -> dict[str, Any]:
        """Nothing to train (the newest checkpoint reached ``train.steps``): say so; summary.json stays as it was."""
        steps, done = self.config.train.steps, self.complete_at
        assert done is not None
        self._log(f"crosstrain: run {self.run_dir} is already complete at step {done} (train.steps={steps}); nothing "
                  f"was trained or written. To train further raise train.steps, e.g. --set train.steps={2 * done}")
        return {"already_complete": True, "steps": done, "run_dir": str(self.run_dir)}

    def _models_summary(self) -> dict[str, Any]:
        """Every model's role, source and hash (trainable ones: of their trained weights; a collective)."""
        out: dict[str, Any] = {}
        for name, m in self.models.items():
            if m is self.primary:
                sha = self.summary["params_sha256"]
            else:
                sha = params_sha256(m.parallel.full_state_dict()) if m.trainable else m.sha256
            out[name] = {"trainable": m.trainable, "source": m.source, "params_sha256": sha}
        return out

    def teardown(self) -> None:
        self.preemption.uninstall()
        if self.rank_metrics is not None:
            self.rank_metrics.close()
        if self.hang_watchdog is not None:
            self.hang_watchdog.close()
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
