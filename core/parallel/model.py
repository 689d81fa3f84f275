"""``parallelize``: apply PP -> TP -> activation checkpointing -> compile -> FSDP/DDP to a GPT (torchtitan order),
and ``ParallelModel``, the one object the trainer drives for forward/backward, clipping and state."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from crosstrain import kernels
from crosstrain.errors import ConfigError
from crosstrain.models.family import family_of
from crosstrain.parallel import activation_checkpoint as ac
from crosstrain.parallel import fsdp as dp
from crosstrain.parallel import grad as gradmod
from crosstrain.parallel import plan as planmod
from crosstrain.parallel import pp as ppmod
from crosstrain.parallel import state as statemod
from crosstrain.parallel.batch_stats import apply_data_parallel
from crosstrain.parallel.dims import ParallelDims
from crosstrain.parallel.ep import apply_ep, check_expert_model, expert_modules
from crosstrain.parallel.mesh import dp_group, ep_mesh, fsdp_mesh

PRECISIONS = ("fp32", "bf16", "fp16")


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``logits [..., vocab]`` against ``targets [...]`` (the default loss)."""
    return kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class LossReduction:
    """An average over data-parallel ranks in flight (:meth:`ParallelModel.start_loss_reduce`)."""

    buf: torch.Tensor
    work: Any
    shape: torch.Size


class ParallelModel:
    """This rank's share of the model, with the training-step primitives the trainer needs.

    Build it with :func:`parallelize`. ``module`` is this rank's ``nn.Module`` (the model wrapped by
    FSDP2/DDP/TP, or its pipeline stage); give ``parameters()`` to the optimizer. ``loss_fn(output, targets)``
    is the loss of :meth:`forward_backward`, :meth:`eval_loss` and the pipeline schedule. A frozen model
    (``trainable`` False) only runs forward, in eval mode.
    """

    def __init__(self, module: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device, *,
                 precision: str, use_ddp: bool, use_fsdp: bool, schedule: Any = None,
                 microbatches: int = 1, loss_fn: LossFn | None = None, trainable: bool = True) -> None:
        self.module = module
        self.loss_fn: LossFn = loss_fn or next_token_loss
        self.trainable = trainable
        self.dims = dims
        self.mesh = mesh
        self.device = device
        self.precision = precision
        self.use_ddp = use_ddp
        self.use_fsdp = use_fsdp
        self.schedule = schedule
        self.microbatches = microbatches
        self.pp_group = mesh["pp"].get_group() if (mesh is not None and dims.pp > 1) else None
        self.pp_rank = mesh.get_local_rank("pp") if self.pp_group is not None else 0
        self.is_first_stage = self.pp_rank == 0
        self.is_last_stage = self.pp_rank == dims.pp - 1
        self.sync_timings = False  # set True to synchronize the device around timed regions
        self._grad_sync = True
        self._loss_mult = 1.0
        self._mb_losses: list[torch.Tensor] = []
        # autocast only where FSDP's MixedPrecisionPolicy does not already cast the parameters
        self._autocast_dtype = None if (precision == "fp32" or use_fsdp) else dp.PARAM_DTYPES[precision]

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def layout_name(self) -> str:
        """What wraps the model's data parallelism, as it runs: ``ddp`` (DDP), ``fsdp`` (FSDP2 over one shard
        dimension), ``hsdp`` (FSDP2 replicated over ``dp_replicate`` and sharded over ``dp_shard``), ``replicate``
        (FSDP2 on ``dp_replicate`` alone, which tp/pp need: each rank holds the full model, gradients
        all-reduced, as DDP) or ``single``; ``+tp``/``+pp``/``+ep`` name the other dimensions."""
        d = self.dims
        if self.use_ddp:
            base = "ddp"
        elif self.use_fsdp:
            base = "hsdp" if d.dp_replicate > 1 and d.dp_shard > 1 else ("fsdp" if d.dp_shard > 1 else "replicate")
        else:
            base = "single"
        extra = "".join(f"+{k}" for k in ("tp", "pp", "ep") if getattr(d, k) > 1)
        return base + extra if base != "single" or not extra else extra[1:]

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters this rank owns (DTensors under FSDP/TP), for the optimizer."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        ddp = self.use_ddp
        for name, p in self.module.named_parameters():
            yield statemod.clean_name(name, ddp), p

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype where FSDP's MixedPrecisionPolicy does not already cast (else no-op)."""
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._autocast_dtype)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync()`` while :meth:`set_gradient_sync` is off (FSDP2 needs nothing here); else no-op.

        Wrap forward *and* backward in it: DDP decides at forward time whether the backward reduces.
        """
        if self.use_ddp and not self._grad_sync:
            return cast(DistributedDataParallel, self.module).no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        """One micro-batch whose loss the caller computes: :meth:`no_sync` and :meth:`autocast` together.

        ``with pm.micro_batch(): loss = f(pm.module(x), y); (loss * scale / divisor).backward()`` computes what
        :meth:`forward_backward` does. Not for pipeline parallelism, where the schedule runs both passes.
        """
        if self.schedule is not None:
            raise ConfigError("ParallelModel.micro_batch() cannot run a pipeline-parallel model; use forward_backward "
                              "(pass the loss as parallelize(loss_fn=...)) or set parallel.pp=1")
        with self.no_sync(), self.autocast():
            yield

    def now(self) -> float:
        """``time.perf_counter()``, after synchronising the device when ``sync_timings`` is set."""
        if self.sync_timings and self.device.type != "cpu":
            torch.accelerator.synchronize()
        return time.perf_counter()

    def start_loss_reduce(self, loss: torch.Tensor, async_op: bool = True) -> LossReduction:
        """Start averaging ``loss`` (any shape) over data-parallel ranks, broadcast from the last pipeline stage:
        a SUM over the world divided by the ranks that hold a loss. Finish with :meth:`finish_loss_reduce`."""
        if self.mesh is None:
            return LossReduction(loss, None, loss.shape)
        buf = loss.detach().float().reshape(-1).clone()
        if not self.is_last_stage:
            buf.zero_()
        work = dist.all_reduce(buf, async_op=async_op)
        return LossReduction(buf, work, loss.shape)

    def finish_loss_reduce(self, handle: LossReduction) -> torch.Tensor:
        """Wait for :meth:`start_loss_reduce`'s average; the same detached fp32 tensor on every rank."""
        if handle.work is not None:
            handle.work.wait()
        if self.mesh is None:
            return handle.buf.detach().float()
        return (handle.buf / (self.dims.dp_degree * self.dims.tp)).reshape(handle.shape)

    # -- training ---------------------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, scale: float = 1.0,
                         divisor: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of one micro-batch; gradients accumulate ``loss * scale / divisor``.

        Returns the detached mean token loss (averaged over data-parallel ranks, the same on every rank) and
        timings in seconds: ``forward_s``, ``backward_s``, ``comm_s`` (waiting for the loss reduction). With
        pipeline parallelism the schedule interleaves both passes, so ``forward_s`` holds the whole schedule
        and ``backward_s`` is 0.
        """
        if not self.trainable:
            raise ConfigError("forward_backward on a frozen model (parallelize(trainable=False)); use eval_loss or "
                              "module under torch.no_grad(), or build it with trainable=True")
        if self.schedule is not None:
            return self._pp_forward_backward(inputs, targets, scale, divisor)
        with self.no_sync():
            t0 = self.now()
            with self.autocast():
                logits = self.module(inputs)
                loss = self.loss_fn(logits, targets)
            t1 = self.now()
            handle = self.start_loss_reduce(loss)
            (loss * (scale / divisor)).backward()
            t2 = self.now()
        mean = self.finish_loss_reduce(handle)
        t3 = self.now()
        return mean, {"forward_s": t1 - t0, "backward_s": t2 - t1, "comm_s": t3 - t2}

    def _pp_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        self._mb_losses.append(loss.detach().float())
        return loss * self._loss_mult

    def _pp_run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        if inputs.shape[0] % self.microbatches:
            raise ConfigError(
                f"batch size {inputs.shape[0]} is not divisible by the {self.microbatches} pipeline micro-batches; "
                "change train.batch_size or parallel.pp_microbatches"
            )
        self._mb_losses = []
        run = self.schedule.step if train else self.schedule.eval
        with self.autocast():
            if self.is_first_stage:
                run(inputs, target=targets if self.is_last_stage else None)
            elif self.is_last_stage:
                run(target=targets)
            else:
                run()
        if self.is_last_stage:
            # the schedule's first step also runs the loss once for shape inference: keep the real ones
            return torch.stack(self._mb_losses[-self.microbatches:]).mean()
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def _pp_forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float,
                             divisor: int) -> tuple[torch.Tensor, dict[str, float]]:
        self._loss_mult = scale / (divisor * self.microbatches)
        t0 = self.now()
        loss = self._pp_run(inputs, targets, train=True)
        t1 = self.now()
        mean = self.finish_loss_reduce(self.start_loss_reduce(loss, async_op=False))
        t2 = self.now()
        return mean, {"forward_s": t1 - t0, "backward_s": 0.0, "comm_s": t2 - t1}

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss without gradients, averaged like :meth:`forward_backward`'s."""
        if self.schedule is not None:
            loss = self._pp_run(inputs, targets, train=False)
        else:
            with self.autocast():
                loss = self.loss_fn(self.module(inputs), targets)
        return self.finish_loss_reduce(self.start_loss_reduce(loss, async_op=False))

    def set_gradient_sync(self, enabled: bool) -> None:
        """Turn the data-parallel gradient reduction off for all but the last micro-batch of an accumulation.

        (With pipeline parallelism the schedule reduces at the end of every ``step``; results stay correct.)
        """
        self._grad_sync = bool(enabled)
        if self.use_fsdp and self.schedule is None:
            cast(FSDPModule, self.module).set_requires_gradient_sync(self._grad_sync)

    def align_grads_(self) -> int:
        """Bring each DTensor gradient to its parameter's placements (before any optimizer reads local shards);
        returns how many moved. See :func:`crosstrain.parallel.grad.align_grads_`."""
        return gradmod.align_grads_(self.module.parameters())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient L2 norm to ``max_norm`` (<= 0: measure only); returns the norm before."""
        return gradmod.clip_grad_norm_(self.module.parameters(), max_norm, self.pp_group, self.device)

    def grad_norm(self) -> torch.Tensor:
        return gradmod.total_grad_norm(self.module.parameters(), self.pp_group, self.device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU tensors named like a plain GPT's ``state_dict``, on every rank (a collective)."""
        local = statemod.local_full_state(self.module, ddp=self.use_ddp)
        if self.pp_group is None:
            return dict(sorted(local.items()))
        comm = torch.device("cpu") if self.device.type == "cpu" else self.device
        return statemod.gather_pipeline_state(local, self.pp_group, comm)

    def train(self, mode: bool = True) -> ParallelModel:
        """Set the module's training mode; a frozen model stays in eval mode."""
        self.module.train(mode and self.trainable)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device, *,
                precision: str = "fp32", activation_checkpoint: str = "none", compile: bool | str = False,
                pp_schedule: str = "1f1b", pp_microbatches: int = 0, loss_fn: LossFn | None = None,
                trainable: bool = True) -> ParallelModel:
    """Shard ``model`` (built identically on every rank) over ``mesh`` and return a ParallelModel.

    Order as in torchtitan: pipeline split, tensor parallel, expert parallel (``parallel.ep > 1``, see
    :mod:`crosstrain.parallel.ep`), activation checkpointing, per-block compile, then FSDP2 (HSDP when both dp
    dims > 1) or DDP; then a trainable model's batch-statistics modules get the data-parallel group
    (:mod:`crosstrain.parallel.batch_stats`). Parameters are kept in fp32 (the master weights); ``precision``
    bf16/fp16 computes in low precision through FSDP's MixedPrecisionPolicy when sharded, through autocast on
    ``device``'s type otherwise.
    ``pp_microbatches <= 0`` means ``pp``. ``compile`` True compiles each block with torch.compile's default
    backend; a string names the dynamo backend.

    TP, PP, activation checkpointing and compile follow the model's plans (see :mod:`crosstrain.parallel.plan`);
    a model without plans trains with DDP/FSDP2 only. ``loss_fn(output, targets)`` defaults to
    :func:`next_token_loss`. ``trainable=False`` builds a frozen model for inference inside a training run: no
    gradients, eval mode, never DDP (a full replica instead), FSDP2 resharding after forward, no pipeline.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision.dtype={precision!r} is not allowed; use one of {', '.join(PRECISIONS)}")
    if dims.dp_shard == -1:
        dims.resolve()
    family = family_of(model)
    if family is not None:  # a model of a registered family (crosstrain.models.family) checks the split itself
        family.validate_parallel(model.config, dims)
    if trainable:  # a frozen dense model (a distillation teacher) under ep: the ep ranks are data-parallel ranks
        check_expert_model(model, dims)
    if compile and dims.tp > 1:
        # Observed with torch 2.13 (aot_eager and inductor): the backward of DTensor's redistribution inside a
        # compiled TP block receives a plain tensor and fails at the first step.
        raise ConfigError("parallel.compile with parallel.tp > 1 fails in this torch build; set compile=false or tp=1")
    every = ac.parse_ac(activation_checkpoint)  # validate before touching the model
    planmod.check_plans(model, tp=dims.tp, pp=dims.pp, activation_checkpoint=activation_checkpoint if every else None,
                        compile=compile)
    if not trainable and dims.pp > 1:
        raise ConfigError(f"a frozen model (trainable=False) cannot be pipelined over parallel.pp={dims.pp}; "
                          "run it with parallel.pp=1")
    world = 1 if mesh is None else mesh.size()
    if world != dims.dp_degree * dims.tp * dims.pp:
        raise ConfigError(f"parallel dims {dims.describe()} do not match the mesh of {world} ranks")
    if str(pp_schedule).lower() not in ppmod.SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule={pp_schedule!r} is not allowed; use one of {', '.join(ppmod.SCHEDULES)}"
        )

    if dims.pp > 1 and str(pp_schedule).lower() == "1f1b" and 0 < pp_microbatches < dims.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs parallel.pp_microbatches >= parallel.pp={dims.pp}, "
                          f"got {pp_microbatches}")
    model = model.to(device=device, dtype=torch.float32)
    schedule = None
    microbatches = 1
    if dims.pp > 1:
        stage = mesh.get_local_rank("pp")
        ppmod.split_stage(model, dims.pp, stage)
    if dims.tp > 1:
        from crosstrain.parallel.tp import apply_tp

        apply_tp(model, mesh["tp"])
    if dims.ep > 1:
        apply_ep(model, ep_mesh(mesh, dims))
    if every:
        ac.apply_ac(model, activation_checkpoint)
    if compile:
        ac.apply_compile(model, compile)

    use_ddp = use_fsdp = False
    module: nn.Module = model
    if not trainable:
        # after TP: its ParallelStyles build new nn.Parameters, which require gradients again
        model.requires_grad_(False)
        model.eval()
    if dims.dp_enabled:
        if dims.dp_shard == 1 and dims.tp == 1 and dims.pp == 1:
            # DDP refuses a module without gradients; a frozen replica needs no wrapper at all
            if trainable:
                module = dp.apply_ddp(model, mesh["dp_replicate"], device)
                use_ddp = True
        else:
            # FSDP2; HSDP on (dp_replicate, dp_shard) - with dp_shard == 1 that is DDP-like, composable with TP/PP
            if dims.ep > 1:  # experts differ per ep rank: they get their own data-parallel group first
                dp.apply_expert_fsdp(expert_modules(model), dp.expert_dp_mesh(mesh, dims), dims.dp_degree,
                                     precision=precision, reshard_after_forward=dims.pp == 1)
            dp.apply_fsdp(model, fsdp_mesh(mesh, dims), precision=precision, reshard_after_forward=dims.pp == 1,
                          units=planmod.units(model))
            use_fsdp = True
        if trainable:  # batch statistics (QAT activation ranges) over the whole data-parallel batch
            apply_data_parallel(model, dp_group(mesh, dims))

    if dims.pp > 1:
        microbatches = pp_microbatches if pp_microbatches > 0 else dims.pp
        holder: dict[str, ParallelModel] = {}
        schedule = ppmod.build_schedule(
            module, mesh.get_local_rank("pp"), dims.pp, device, mesh["pp"].get_group(),
            schedule=pp_schedule, microbatches=microbatches,
            loss_fn=lambda out, tgt: holder["pm"]._pp_loss(out, tgt),
        )
    pm = ParallelModel(module, dims, mesh, device, precision=precision, use_ddp=use_ddp, use_fsdp=use_fsdp,
                       schedule=schedule, microbatches=microbatches, loss_fn=loss_fn, trainable=trainable)
    if dims.pp > 1:
        holder["pm"] = pm
    return pm
