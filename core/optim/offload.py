"""Optimizer-state offload: fp32 master weights and optimizer states in host memory (the ZeRO-Offload idea).

:class:`OffloadOptimizer` keeps, for every parameter, an fp32 master copy and the AdamW moments (or the SGD
momentum buffer) in host memory. Each step copies the gradients to the host, runs the fused ``adamw_step`` /
``sgd_step`` op from the kernel registry on the host tensors (the CPU backend's native kernel when built)
and copies the new parameters, rounded to the parameters' dtype by the kernel itself, back to the device.

It is device-agnostic: it only uses the active backend's ``Device`` (``pin_memory`` for the transfer
buffers, ``stream()`` / ``event()`` to overlap copies with the host update where the device has streams).
On the CPU the parameters already live in host memory, so nothing is copied: a bf16 model trains with
fp32 master weights and the kernel writes the bf16 parameters in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from crosstrain.errors import ConfigError
from crosstrain.kernels import registry
from crosstrain.optim.host_state import closure_loss
from crosstrain.parallel.local import local_tensor

log = logging.getLogger("crosstrain.optim")

_HOST = torch.device("cpu")
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULTS: dict[str, Any] = {"name": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                             "momentum": 0.0}


def _backend_device() -> Any:
    try:
        from crosstrain.registry import active_backend

        return active_backend().device()
    except Exception as exc:  # standalone use without a usable backend: plain copies, no pinning
        log.debug("OffloadOptimizer: no active backend device (%s); using unpinned synchronous copies", exc)
        return None


class OffloadOptimizer(torch.optim.Optimizer):
    """AdamW or SGD whose fp32 master weights and states live in host memory; see the module docstring.

    ``OffloadOptimizer(params, optim_cfg, device)`` is how the optimizer factory builds it (``optim.offload =
    true``); keyword arguments override the config (``name``, ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``momentum``, ``nesterov``, ``amsgrad``). ``stage=True`` forces the device path (host staging buffers and
    copies) even for host parameters, ``overlap=False`` disables streams, ``reference=True`` runs the pure-torch
    reference update instead of the backend's kernel (``optim.impl = "torch"``). ``state[p]`` holds ``master``,
    ``exp_avg``, ``exp_avg_sq`` (AdamW) or ``momentum_buffer`` (SGD), all fp32 host tensors shaped like the
    parameter's local shard, and ``step``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        config: Any = None,
        device: torch.device | None = None,
        *,
        name: str | None = None,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        nesterov: bool = False,
        amsgrad: bool = False,
        stage: bool | None = None,
        overlap: bool = True,
        reference: bool = False,
    ) -> None:
        def pick(key: str, value: Any) -> Any:
            return value if value is not None else getattr(config, key, _DEFAULTS[key])

        self.kind = str(pick("name", name))
        if self.kind not in ("adamw", "sgd"):
            raise ConfigError(f"optim.name={self.kind!r} cannot be offloaded; use adamw or sgd")
        lr, wd = float(pick("lr", lr)), float(pick("weight_decay", weight_decay))
        if self.kind == "adamw":
            b1, b2 = (float(b) for b in pick("betas", betas))
            defaults: dict[str, Any] = dict(lr=lr, betas=(b1, b2), eps=float(pick("eps", eps)), weight_decay=wd,
                                            amsgrad=bool(amsgrad))
        else:
            mom = float(pick("momentum", momentum))
            if nesterov and mom <= 0:
                raise ConfigError("OffloadOptimizer: nesterov needs momentum > 0; set optim.momentum")
            defaults = dict(lr=lr, momentum=mom, dampening=0.0, weight_decay=wd, nesterov=bool(nesterov))
        super().__init__(self._groups(params, config, wd), defaults)
        self.device = device
        self._dev = _backend_device()
        self._stage_forced = stage
        self._overlap = overlap
        self._reference = reference
        self._stream: Any = None
        self._staging: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _PARAM_DTYPES:
                    raise ConfigError(f"OffloadOptimizer takes fp32/bf16/fp16 parameters, got {p.dtype}; "
                                      "cast the model or set optim.offload=false")
                self._init_state(p, group)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _groups(params: Iterable[Any], config: Any, weight_decay: float) -> Any:
        params = list(params)
        if config is None or not params or not all(isinstance(p, torch.Tensor) for p in params):
            return params
        try:  # same weight-decay split as the on-device optimizers (matrices only)
            from crosstrain.optim.factory import param_groups
        except ImportError:
            return params
        return [g for g in param_groups(params, weight_decay) if g["params"]]

    def _staged(self, p: torch.Tensor) -> bool:
        if self._stage_forced is not None:
            return self._stage_forced
        return local_tensor(p).device.type != "cpu"

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        if self._dev is None:
            return t
        try:
            return self._dev.pin_memory(t)
        except RuntimeError as exc:  # e.g. no driver for pinning: keep pageable memory
            log.warning("OffloadOptimizer: pinning failed (%s); using pageable host memory", exc)
            self._dev = None
            return t

    def _host_fp32(self, p: torch.Tensor, src: torch.Tensor | None = None, pin: bool = False) -> torch.Tensor:
        local = local_tensor(p)
        out = torch.empty(local.shape, dtype=torch.float32, device=_HOST)
        if src is None:
            out.zero_()
        else:
            out.copy_(src)
        return self._pin(out) if pin else out

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if state:
            return
        local = local_tensor(p).detach()
        staged = self._staged(p)
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        # the master is copied back directly when the parameter is fp32 on a device: pin it then
        state["master"] = self._host_fp32(p, local, pin=staged and local.dtype == torch.float32)
        if self.kind == "adamw":
            state["exp_avg"] = self._host_fp32(p)
            state["exp_avg_sq"] = self._host_fp32(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = self._host_fp32(p)
        elif group["momentum"] != 0:
            state["momentum_buffer"] = self._host_fp32(p)
        if staged:
            buffers = {"grad": self._pin(torch.empty(local.shape, dtype=local.dtype, device=_HOST))}
            if local.dtype != torch.float32:
                buffers["out"] = self._pin(torch.empty(local.shape, dtype=local.dtype, device=_HOST))
            self._staging[p] = buffers

    def _copy_stream(self) -> Any:
        if not self._overlap or self._dev is None:
            return None
        if self._stream is None:
            try:
                self._stream = self._dev.stream()
            except Exception as exc:
                log.warning("OffloadOptimizer: no copy stream (%s); copies run synchronously", exc)
                self._overlap = False
        return self._stream

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        staged = [(group, p) for group, p in work if self._staged(p)]
        device = next((local_tensor(p).device for _, p in staged if local_tensor(p).device.type != "cpu"), None)
        stream = self._copy_stream() if device is not None else None
        events: dict[torch.Tensor, Any] = {}
        if staged:
            self._grads_to_host(staged, stream, events, device)
        with registry.use_reference() if self._reference else contextlib.nullcontext():
            for group, p in work:
                if p in events:
                    events[p].synchronize()
                self._update(group, p)
                if p in self._staging:
                    self._params_to_device(p, stream)
        if stream is not None:
            torch.accelerator.current_stream(device).wait_stream(stream)
        return loss

    def _grads_to_host(self, staged: list, stream: Any, events: dict, device: torch.device | None) -> None:
        if stream is None:
            for _, p in staged:
                self._grad_buffer(p).copy_(local_tensor(p.grad))
            return
        stream.wait_stream(torch.accelerator.current_stream(device))
        with stream:
            for _, p in staged:
                self._grad_buffer(p).copy_(local_tensor(p.grad), non_blocking=True)
                event = self._dev.event()
                event.record(stream)
                events[p] = event

    def _grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        buffers = self._staging.get(p)
        if buffers is None:  # a parameter added to the optimizer after construction
            self._init_state(p, next(g for g in self.param_groups if any(q is p for q in g["params"])))
            buffers = self._staging[p]
        assert p.grad is not None
        grad = local_tensor(p.grad)
        if buffers["grad"].dtype != grad.dtype:
            buffers["grad"] = self._pin(torch.empty(grad.shape, dtype=grad.dtype, device=_HOST))
        return buffers["grad"]

    def _params_to_device(self, p: torch.Tensor, stream: Any) -> None:
        buffers = self._staging[p]
        src = buffers.get("out", self.state[p]["master"])
        dst = local_tensor(p.data)
        if stream is None:
            dst.copy_(src)
        else:
            with stream:
                dst.copy_(src, non_blocking=True)

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            self._init_state(p, group)
        master = state["master"]
        if p in self._staging:
            grad = self._staging[p]["grad"]
            out = self._staging[p].get("out")
        else:
            assert p.grad is not None
            grad = local_tensor(p.grad)
            local = local_tensor(p.data)
            out = None if local.dtype == torch.float32 and local.data_ptr() == master.data_ptr() else local
        step = int(state["step"].item()) + 1
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if self.kind == "adamw":
            beta1, beta2 = group["betas"]
            registry.call("adamw_step", master, grad, state["exp_avg"], state["exp_avg_sq"],
                          state.get("max_exp_avg_sq") if group["amsgrad"] else None, out, step=step, lr=group["lr"],
                          beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        else:
            registry.call("sgd_step", master, grad, state.get("momentum_buffer"), out, lr=group["lr"],
                          momentum=group["momentum"], dampening=group["dampening"],
                          weight_decay=group["weight_decay"], nesterov=group["nesterov"], first_step=step == 1)

    # ------------------------------------------------------------------ state and accounting
    def state_dict(self) -> dict[str, Any]:
        """torch's layout; states of DTensor parameters become DTensors with the parameter's placements.

        The host tensors are wrapped, not copied, so distributed checkpointing (DCP) saves and loads each
        rank's own shard (a plain tensor would be taken as replicated: rank 0's shard for everyone).
        """
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            entry = sd["state"].get(index)
            mesh = getattr(p, "device_mesh", None)
            if entry is None or mesh is None:
                continue
            from torch.distributed.tensor import DTensor

            entry = sd["state"][index] = dict(entry)  # never alter the live state dict
            for key, value in entry.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.shape == local_tensor(p).shape:
                    entry[key] = DTensor.from_local(value, mesh, p.placements, run_check=False, shape=p.shape,
                                                    stride=p.stride())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the host state in place (fp32, pinned buffers kept); nothing is moved to the device."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ConfigError("the optimizer state does not match the parameters (different model or "
                              "optimizer layout); load a checkpoint of this configuration")
        by_id = {pid: p for saved, group in zip(saved_groups, self.param_groups, strict=True)
                 for pid, p in zip(saved["params"], group["params"], strict=True)}
        for pid, entry in state_dict["state"].items():
            p = by_id[pid]
            state = self.state[p]
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    state[key] = value
                    continue
                value = local_tensor(value).detach()
                if key == "step":
                    state[key] = value.to(_HOST, torch.float32, copy=True)
                elif isinstance(state.get(key), torch.Tensor) and state[key].shape == value.shape:
                    if state[key].data_ptr() != value.data_ptr():
                        state[key].copy_(value)
                else:
                    state[key] = self._host_fp32(p, value.reshape(local_tensor(p).shape),
                                                 pin=key == "master" and self._staged(p)
                                                 and local_tensor(p).dtype == torch.float32)
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def memory_report(self) -> dict[str, int]:
        """Bytes of host state, of pinned staging buffers, and of device memory an on-device optimizer needs.

        ``device_bytes_saved`` counts the fp32 states (and fp32 masters of low-precision parameters) that
        this optimizer keeps on the host instead of the device.
        """
        host = pinned = saved = 0
        for p, state in self.state.items():
            on_device = local_tensor(p).device.type != "cpu"
            for key, t in state.items():
                if not isinstance(t, torch.Tensor) or key == "step":
                    continue
                nbytes = t.numel() * t.element_size()
                host += nbytes
                if on_device and (key != "master" or local_tensor(p).dtype != torch.float32):
                    saved += nbytes
        for buffers in self._staging.values():
            pinned += sum(t.numel() * t.element_size() for t in buffers.values())
        return {"offload_host_bytes": host, "offload_staging_bytes": pinned, "offload_device_bytes_saved": saved}
