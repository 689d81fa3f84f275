"""``FusedAdamW`` and ``FusedSGD``: torch.optim optimizers whose step is one fused pass per parameter.

Both dispatch through the kernel registry (ops ``adamw_step`` / ``sgd_step``), so host tensors run the native
kernel and anything else (other devices, non-contiguous tensors, ``kernels = "reference"``) the pure-torch
reference. fp32 parameters are updated in place; bf16/fp16 parameters get an fp32 master copy in the
optimizer state, and the kernel writes the rounded new value straight back into the parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from crosstrain.errors import ConfigError, KernelError
from crosstrain.kernels import registry
from crosstrain.optim.host_state import closure_loss, restore_fp32_state
from crosstrain.parallel.local import local_tensor

log = logging.getLogger("crosstrain.optim")

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_warned_missing = False


def _warn_if_missing() -> None:
    global _warned_missing
    from crosstrain.backends.cpu import native

    if not native.available() and not _warned_missing:
        _warned_missing = True
        try:
            native.load()
        except KernelError as exc:
            log.warning("%s; fused optimizers use the pure-torch reference step", exc)


class _FusedBase(torch.optim.Optimizer):
    """Shared parameter checks, fp32 master handling, state loading and the step loop (subclasses write
    :meth:`_update`)."""

    _fp32_keys: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _PARAM_DTYPES:
                    dtype = str(p.dtype).replace("torch.", "")
                    raise KernelError(f"{type(self).__name__} takes fp32/bf16/fp16 parameters, got {dtype}; "
                                      "use the matching torch.optim optimizer")
        _warn_if_missing()

    @staticmethod
    def _zeros(p: torch.Tensor) -> torch.Tensor:
        """An fp32 state tensor like ``p``: a DTensor with ``p``'s placements for FSDP2/TP parameters, so
        checkpoints reshard the state exactly as torch.optim's."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    @staticmethod
    def _master_and_out(p: torch.Tensor, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fp32 tensor the kernel updates and the low-precision tensor it writes (None for fp32 params);
        both process-local (a DTensor's shard)."""
        if p.dtype == torch.float32:
            return local_tensor(p.data), None
        if "master" not in state:
            state["master"] = p.detach().to(torch.float32, copy=True)
        local = local_tensor(p.data)
        return local_tensor(state["master"]).view(local.shape), local

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            raise KernelError("fused optimizers do not take sparse gradients; use torch.optim.SparseAdam")
        return local_tensor(grad)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        restore_fp32_state(self, state_dict, self._fp32_keys)

    #: :meth:`step` takes ``grad_scale``: the training loop hands it the clipping factor instead of scaling the
    #: gradients in place (the kernel multiplies each gradient as it loads it, in fp32)
    takes_grad_scale = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scale: float = 1.0) -> Any:
        """One update of every parameter with a gradient, read as ``grad * grad_scale`` (the gradients are left
        as they are)."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p, self._grad(p), self.state[p], float(grad_scale))
        return loss

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                grad_scale: float) -> None:
        """One parameter's update from its process-local gradient times ``grad_scale``."""
        raise NotImplementedError


class FusedAdamW(_FusedBase):
    """AdamW (decoupled weight decay, bias correction, optional amsgrad) as one fused pass per tensor.

    Matches ``torch.optim.AdamW`` (same hyper-parameters and defaults); low-precision parameters keep an fp32
    master in ``state["master"]``.
    """

    _fp32_keys = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ConfigError(f"FusedAdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"FusedAdamW: betas must be in [0, 1), got {tuple(betas)}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ConfigError(f"FusedAdamW: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                grad_scale: float) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._zeros(p)
            state["exp_avg_sq"] = self._zeros(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = self._zeros(p)
        master, out = self._master_and_out(p, state)
        step = int(state["step"].item()) + 1
        state["step"] = torch.tensor(float(step), dtype=torch.float32)  # new tensor: never shared
        max_sq = state.get("max_exp_avg_sq") if group["amsgrad"] else None
        beta1, beta2 = group["betas"]
        registry.call(
            "adamw_step", master, grad, local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"]),
            None if max_sq is None else local_tensor(max_sq), out,
            step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], maximize=group["maximize"], grad_scale=grad_scale,
        )


class FusedSGD(_FusedBase):
    """SGD with optional (nesterov) momentum, dampening and weight decay, as one fused pass per tensor.

    Matches ``torch.optim.SGD``; low-precision parameters keep an fp32 master in ``state["master"]``.
    """

    _fp32_keys = ("master", "momentum_buffer")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        if not lr >= 0.0 or not momentum >= 0.0 or not weight_decay >= 0.0:
            raise ConfigError(f"FusedSGD: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, "
                              f"{weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("FusedSGD: nesterov needs momentum > 0 and dampening = 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize)
        super().__init__(params, defaults)

    def _update(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                grad_scale: float) -> None:
        master, out = self._master_and_out(p, state)
        momentum = group["momentum"]
        first = False
        buf = None
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = self._zeros(p)
                first = True
            buf = local_tensor(buf)
        registry.call(
            "sgd_step", master, grad, buf, out, lr=group["lr"], momentum=momentum,
            dampening=group["dampening"], weight_decay=group["weight_decay"], nesterov=group["nesterov"],
            first_step=first, maximize=group["maximize"], grad_scale=grad_scale,
        )
