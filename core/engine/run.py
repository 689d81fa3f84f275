"""The :class:`Run`: what a training or eval run is made of, built once by :func:`build_run`.

``build_run(config)`` checks the config, picks the backend, joins the process group, builds the mesh, the
recipe's models (transformed by plugins, parallelised, with an optimizer and LR schedule each if trainable),
its datasets, the data sampler and the loss scaler. Nothing is written: the run dir, checkpoints and metrics
are the :class:`~crosstrain.engine.trainer.Trainer`'s parts; ``crosstrain eval`` builds a run with
``for_eval=True`` and no Trainer. The parts of the loop take the fields they need from the value
(torchtitan's trainer components, Lightning Fabric's accelerator/strategy/precision split).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from crosstrain import pluginmanager, registry
from crosstrain.config import Config, check_world
from crosstrain.data import DistributedBatchSampler
from crosstrain.distenv import DistEnv
from crosstrain.engine import fast_defaults
from crosstrain.engine.capabilities import check_capabilities
from crosstrain.engine.context import RunContext
from crosstrain.engine.evaluate import eval_batches, evaluate, fit_eval_batch
from crosstrain.engine.flops import count_flops, training_flops_per_token
from crosstrain.engine.loss_scale import DynamicLossScaler
from crosstrain.engine.models import TrainedModel, check_specs, frozen_sha256, transform_specs
from crosstrain.engine.recipe import Recipe, RecipeDataset, resolve_recipe
from crosstrain.engine.watchdog import check_hang_dump
from crosstrain.optim.factory import build_optimizer
from crosstrain.optim.schedules import build_schedule
from crosstrain.parallel.dims import ParallelDims

#: below this many parameters ``train.threads = 0`` uses one host thread (op overhead dominates small models).
AUTO_SINGLE_THREAD_PARAMS = 20_000_000

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EvalData:
    """The recipe's held-out samples and how this rank reads them (``[eval]``)."""

    dataset: RecipeDataset
    batch_size: int
    max_batches: int
    dp_rank: int
    dp_size: int

    @property
    def batches(self) -> int:
        return eval_batches(len(self.dataset), self.batch_size, self.max_batches)


@dataclass
class Run:
    """One run's backend, process group, mesh, models, data, sampler and loss scaler (this rank's view).

    ``close()`` gives back what building it changed: the host thread count, the kernel mode and the process
    group it created.
    """

    config: Config
    recipe: Recipe
    backend: Any  # crosstrain.backend.Backend
    device_api: Any
    device: torch.device
    collective: Any
    local_rank: int
    dims: ParallelDims
    mesh: Any
    context: RunContext
    models: dict[str, TrainedModel]
    dataset: RecipeDataset
    eval: EvalData | None
    sampler: DistributedBatchSampler
    scaler: DynamicLossScaler
    compile_choice: fast_defaults.CompileChoice
    flops_per_token: float
    mfu_flops: dict[str, dict[str, Any]]
    peak_flops: float  # of the device at precision.dtype (0: unknown); MFU divides by it
    undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def trainable(self) -> list[TrainedModel]:
        return [m for m in self.models.values() if m.trainable]

    @property
    def primary(self) -> TrainedModel:
        """The first trainable model: summary.json's ``params_sha256`` and ``final_state_dict`` describe it."""
        return next(m for m in self.models.values() if m.trainable)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.config.precision.dtype]

    def evaluate(self) -> dict[str, float]:
        """Evaluate the models on the recipe's held-out samples now (every rank; see crosstrain.engine.evaluate),
        then once more inside each plugin's eval variant (``crosstrain_eval_variants``: ``eval/<name>/<metric>``)."""
        assert self.eval is not None
        e = self.eval

        def run() -> dict[str, float]:
            return evaluate(self.recipe, self.models, self.primary, e.dataset, batch_size=e.batch_size,
                            max_batches=e.max_batches, dp_rank=e.dp_rank, dp_size=e.dp_size, device=self.device)

        results = run()
        for _, variants in pluginmanager.call_strict("crosstrain_eval_variants", "name its eval variants",
                                                     config=self.config):
            for name, enter in (variants or {}).items():
                with contextlib.ExitStack() as stack:
                    for m in self.models.values():
                        stack.enter_context(enter(m.module))
                    extra = run()
                results.update({f"eval/{name}/{k[len('eval/'):]}": v for k, v in extra.items()
                                if k.startswith("eval/")})
                results["time_eval_s"] = results.get("time_eval_s", 0.0) + extra.get("time_eval_s", 0.0)
        if self.config.eval.tasks:
            start = time.perf_counter()
            results.update({f"eval/{k}": v for k, v in self.score_tasks(self.config.eval.tasks,
                                                                         self.config.eval.tasks_limit)["scores"].items()})
            results["time_eval_s"] = results.get("time_eval_s", 0.0) + time.perf_counter() - start
        return results

    def score_tasks(self, tasks: list[str], limit: int | None = None, num_fewshot: int | None = None,
                    log_samples: bool = False) -> dict[str, Any]:
        """Benchmark tasks on the primary model (:mod:`crosstrain.engine.evaluate_tasks`; one process only)."""
        from crosstrain.data.hf_tokenizer import describe_tokenizer
        from crosstrain.engine.evaluate_tasks import TaskRequest, score_tasks

        return score_tasks(TaskRequest(self.primary.module, describe_tokenizer(self.config.data.tokenizer),
                                       tuple(tasks), limit, num_fewshot, log_samples, self.primary.parallel.autocast))

    def close(self) -> None:
        """Restore the thread count and kernel mode and leave the process group this run created."""
        _run_undo(self.undo)


def _run_undo(undo: list[Callable[[], None]]) -> None:
    """Run every undo step, newest first, even if one fails (the first failure is raised after the rest ran)."""
    failed: list[Exception] = []
    while undo:
        try:
            undo.pop()()
        except Exception as exc:
            failed.append(exc)
    if failed:
        raise failed[0]


def build_run(config: Config, recipe: Recipe | None = None, for_eval: bool = False, start_step: int = 0) -> Run:
    """Build the run ``config`` describes (all ranks call it together); nothing is written to disk.

    ``recipe``: an instance to train (e.g. the federated client's); None resolves ``train.recipe`` by name.
    ``for_eval``: for ``crosstrain eval``: the held-out data is built whatever ``eval.every`` says, nothing is
    compiled under ``parallel.compile = "auto"`` and trainable models get no optimizer.
    ``start_step``: the step a resumed run starts from (``parallel.compile = "auto"`` weighs the steps left).
    """
    cfg = config
    backend = registry.set_active_backend(None if cfg.backend == "auto" else cfg.backend)
    # everything a user can get wrong, checked before any process group or model exists
    check_capabilities(backend, cfg)
    check_hang_dump(cfg)
    env = DistEnv.from_env()
    device_api = backend.device()
    dims = check_world(cfg, env.world_size, _memory_per_rank(device_api, env.local_world_size))
    recipe = recipe or resolve_recipe(cfg.train.recipe)
    recipe.validate(cfg)
    undo: list[Callable[[], None]] = []
    try:
        return _build(cfg, recipe, backend, device_api, env, dims, for_eval, undo, start_step)
    except BaseException:
        with contextlib.suppress(Exception):  # the build's own error is the one to report
            _run_undo(undo)
        raise


def _memory_per_rank(device_api: Any, local_world_size: int) -> int:
    """The device memory one rank may use (ranks sharing a device, or the host, split it); 0 if unknown."""
    sharing = max(1, -(-local_world_size // max(device_api.device_count(), 1)))
    return int(device_api.memory_stats().total) // sharing


def _build(
    cfg: Config,
    recipe: Recipe,
    backend: Any,
    device_api: Any,
    env: DistEnv,
    dims: ParallelDims,
    for_eval: bool,
    undo: list[Callable[[], None]],
    start_step: int = 0,
) -> Run:
    from crosstrain.kernels import registry as kernel_registry
    from crosstrain.parallel import build_mesh, dp_rank_and_size

    if cfg.kernels.mode != "auto":
        before = kernel_registry.mode
        undo.append(lambda: kernel_registry.set_mode(before))
        kernel_registry.set_mode(cfg.kernels.mode)
    collective = backend.collective()
    if not collective.initialized:
        undo.append(collective.destroy)
    collective.init(timeout=cfg.fault.collective_timeout_s)
    device = device_api.device_for_local_rank(env.local_rank)
    device_api.set_device(device)
    torch.manual_seed(cfg.train.seed)
    device_api.manual_seed(cfg.train.seed)
    mesh = build_mesh(collective, dims)
    context = RunContext(
        config=cfg,
        recipe=recipe.name,
        rank=collective.rank,
        world_size=collective.world_size,
        local_rank=env.local_rank,
        dims=dims,
        mesh=mesh,
        device=device,
        backend=backend.name,
    )
    models, choice = _build_models(cfg, recipe, context, backend, device_api, for_eval, undo, start_step)
    flops_per_token, mfu_flops = count_flops(  # every model's FLOPs, frozen ones forward only
        ((n, m.module, m.trainable) for n, m in models.items()), cfg.train.seq_len
    )
    primary = next(m for m in models.values() if m.trainable)
    context.models = {n: m.module for n, m in models.items()}
    context.optimizers = {n: m.optimizer for n, m in models.items() if m.optimizer is not None}
    context.model_config = getattr(primary.module, "config", None)
    dataset = recipe.build_dataset(context)
    dp_rank, dp_size = dp_rank_and_size(mesh, dims)
    eval_data = None
    if cfg.eval.every or for_eval:
        held_out = recipe.build_eval_dataset(context)
        if held_out is not None:
            batch_size, notice = fit_eval_batch(len(held_out), cfg.eval.batch_size or cfg.train.batch_size,
                                                bool(cfg.eval.batch_size), dp_size, primary.parallel.microbatches)
            if notice:
                context.emit_event("eval_batch_fitted", notice, batch_size=batch_size)
            eval_data = EvalData(held_out, batch_size, cfg.eval.max_batches, dp_rank, dp_size)
    scaler = DynamicLossScaler(
        cfg.precision.dtype == "fp16", cfg.precision.init_loss_scale, cfg.precision.loss_scale_growth_interval
    )
    sampler = DistributedBatchSampler(
        len(dataset),
        cfg.train.batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batches=cfg.train.grad_accum,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
    )
    peak_flops = float(device_api.peak_flops(DTYPES[cfg.precision.dtype]) or 0.0)
    return Run(
        config=cfg,
        recipe=recipe,
        backend=backend,
        device_api=device_api,
        device=device,
        collective=collective,
        local_rank=env.local_rank,
        dims=dims,
        mesh=mesh,
        context=context,
        models=models,
        dataset=dataset,
        eval=eval_data,
        sampler=sampler,
        scaler=scaler,
        compile_choice=choice,
        flops_per_token=flops_per_token,
        mfu_flops=mfu_flops,
        peak_flops=peak_flops,
        undo=undo,
    )


def _build_models(
    cfg: Config,
    recipe: Recipe,
    context: RunContext,
    backend: Any,
    device_api: Any,
    for_eval: bool,
    undo: list[Callable[[], None]],
    start_step: int = 0,
) -> tuple[dict[str, TrainedModel], fast_defaults.CompileChoice]:
    """The recipe's models, transformed by plugins, parallelised, with an optimizer each if trainable."""
    from crosstrain.parallel import parallelize

    dims, device = context.dims, context.device
    specs = recipe.build_models(context)
    check_specs(specs, recipe, dims.pp)
    built = transform_specs(specs, cfg)
    _set_threads(cfg.train.threads, list(built.values()), undo)
    trainable_built = [built[n] for n, spec in specs.items() if spec.trainable]
    choice = decide_compile(
        cfg, dims, device_api, context.world_size, trainable_built[0] if trainable_built else None, for_eval,
        start_step,
    )
    models: dict[str, TrainedModel] = {}
    for name, spec in specs.items():
        module = built[name]
        sha = "" if spec.trainable else frozen_sha256(module)
        pm = parallelize(
            module,
            dims,
            context.mesh,
            device,
            precision=cfg.precision.dtype,
            activation_checkpoint=cfg.parallel.activation_checkpoint if spec.trainable else "none",
            compile=choice.enabled and spec.trainable,
            pp_schedule=cfg.parallel.pp_schedule,
            pp_microbatches=cfg.parallel.pp_microbatches,
            trainable=spec.trainable,
            loss_fn=recipe.pipeline_loss if dims.pp > 1 else None,
        )
        slot = TrainedModel(name, pm, spec.trainable, spec.source or f"recipe {recipe.name}", sha)
        if spec.trainable and not for_eval:
            scales = _lr_scales(spec.lr_scale, slot.module) if spec.lr_scale else None
            slot.optimizer = build_optimizer(slot.params, cfg.optim, device, backend=backend, lr_scales=scales)
            slot.schedule = build_schedule(slot.optimizer, cfg.schedule, cfg.schedule.total_steps or cfg.train.steps)
        models[name] = slot
    return models, choice


def _lr_scales(by_name: dict[str, float], module: torch.nn.Module) -> dict[int, float]:
    """A recipe's per-name lr multipliers keyed by the parallelised parameters' ids (their names lose the wrappers'
    prefixes: DDP's ``module.``, compile's ``_orig_mod.``)."""
    from crosstrain.parallel.state import clean_name

    return {id(p): by_name[clean_name(n, ddp=True)] for n, p in module.named_parameters()
            if clean_name(n, ddp=True) in by_name}


def _set_threads(threads: int, models: list[torch.nn.Module], undo: list[Callable[[], None]]) -> None:
    if threads == 0 and "OMP_NUM_THREADS" not in os.environ:
        if sum(p.numel() for m in models for p in m.parameters()) < AUTO_SINGLE_THREAD_PARAMS:
            threads = 1
    if threads:
        before = torch.get_num_threads()
        undo.append(lambda: torch.set_num_threads(before))
        torch.set_num_threads(threads)


def decide_compile(
    cfg: Config, dims: ParallelDims, device_api: Any, world_size: int, module: torch.nn.Module | None, for_eval: bool,
    start_step: int = 0,
) -> fast_defaults.CompileChoice:
    """``parallel.compile`` resolved for the primary model (see :mod:`crosstrain.engine.fast_defaults`) over the
    steps left after ``start_step`` (a resumed run amortises a compile over what it still trains)."""
    from crosstrain.parallel.plan import find_plan

    requested = cfg.parallel.compile
    if module is None:
        return fast_defaults.CompileChoice(False, "no trainable model")
    if for_eval and requested == "auto":
        return fast_defaults.CompileChoice(False, "crosstrain eval: no training steps to amortise a compile")
    micro = max(cfg.train.batch_size // max(dims.dp_degree, 1) // cfg.train.grad_accum, 1)
    key = fast_defaults.model_key(module, dims, cfg.precision.dtype, micro, cfg.train.seq_len)
    est_step_s = 0.0
    if requested == "auto":
        peak = float(device_api.peak_flops(DTYPES[cfg.precision.dtype]) or 0.0)
        work = training_flops_per_token(module, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
        est_step_s = work / world_size / (peak * fast_defaults.EAGER_MFU) if peak > 0 else 0.0
    choice = fast_defaults.decide_compile(
        requested, dims, find_plan(module, "ac_units") is not None, max(cfg.train.steps - start_step, 0),
        est_step_s, key,
    )
    if choice.enabled:
        fast_defaults.enable_compile_caches()
    return choice
