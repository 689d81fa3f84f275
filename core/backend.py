"""The Backend: what a hardware plug-in hands to crosstrain through the ``crosstrain_register_backends`` hook.

A backend bundles the four interfaces for one accelerator type: its :class:`~crosstrain.device.Device`,
a :class:`~crosstrain.collective.Collective` bound to that device, kernel implementations registered into
the :class:`~crosstrain.kernels.KernelRegistry`, and the checkpointer every trainer checkpoint is written and read
through (the core's default unless the backend overrides it). ``crosstrain doctor`` also asks each backend for
the packages and environment variables that matter to it, so the core never names them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from crosstrain.device import CAPABILITIES, Availability, Device

if TYPE_CHECKING:
    from crosstrain.checkpoint.dcp import DCPCheckpointer
    from crosstrain.collective import Collective
    from crosstrain.kernels import KernelRegistry


class Backend:
    """Base class for backends. Subclasses set ``name``, ``priority``, ``capabilities`` and ``make_device``."""

    #: unique name, also the value of ``CROSSTRAIN_BACKEND`` and config ``backend``.
    name: str = ""
    #: ``backend = "auto"`` picks the available backend with the highest priority.
    priority: int = 0
    #: subset of :data:`crosstrain.device.CAPABILITIES`.
    capabilities: frozenset[str] = frozenset()
    #: names of the extras that install what this backend needs (shown in error messages).
    install_hint: str = ""
    #: the Kubernetes extended resource of one device, which the device plugin of this hardware advertises
    #: (``crosstrain k8s`` requests ``--nproc-per-node`` of it per pod); "" = none, the pod asks for cpu/memory only.
    k8s_resource: str = ""

    def __init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"backend {self.name!r} declares unknown capabilities {sorted(unknown)}")
        self._device: Device | None = None

    def make_device(self) -> Device:
        """Build this backend's Device (called once, lazily)."""
        raise NotImplementedError

    def device(self) -> Device:
        if self._device is None:
            self._device = self.make_device()
        return self._device

    def availability(self) -> Availability:
        """Run-time probe; never raises (a failing probe is reported as unavailable with its error)."""
        try:
            return self.device().availability()
        except Exception as exc:  # a probe must never break discovery
            return Availability(False, f"probe failed: {type(exc).__name__}: {exc}")

    def collective(self) -> Collective:
        """A Collective bound to this backend's device and torch.distributed backend."""
        from crosstrain.collective import Collective

        return Collective(self.device())

    def register_kernels(self, registry: KernelRegistry) -> None:
        """Register this backend's fast kernel implementations (default: none, references are used)."""

    def fast_optimizer(self, name: str, groups: list[dict[str, Any]], hyper: dict[str, Any]
                       ) -> tuple[torch.optim.Optimizer, str] | None:
        """This backend's fastest optimizer step for ``name`` ("adamw" | "sgd") whose numerics match
        ``torch.optim`` within fp32 rounding, with a label for summary.json; None: use plain ``torch.optim``.

        Default: torch's own fused kernels (``fused=True``), where torch has them for the parameters' device.
        ``hyper`` holds the torch.optim keyword arguments (lr, betas, eps or momentum).
        """
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}.get(name)
        if cls is None:
            return None
        try:
            return cls(groups, **hyper, fused=True), "torch-fused"
        except (RuntimeError, ValueError, TypeError):  # no fused kernel for this device type or dtype
            return None

    def checkpointer(self) -> DCPCheckpointer:
        """A new, unbound checkpointer that :class:`~crosstrain.checkpoint.manager.CheckpointManager` (so every
        trainer checkpoint) saves and loads through. Default: the core's sharded DCP checkpointer on the local
        filesystem. To change where or how the bytes go, return a subclass that sets ``writer_factory`` /
        ``reader_factory`` (DCP storage writer and reader classes); the commit protocol and format stay the core's.
        """
        from crosstrain.checkpoint.dcp import DCPCheckpointer

        return DCPCheckpointer()

    def doctor_lines(self) -> list[tuple[str, str]]:
        """``(label, value)`` pairs ``crosstrain doctor`` shows under this backend: the packages it needs and
        the environment variables it reads (only those set). Default: the device's visible-devices variable."""
        from crosstrain.diagnostics import env_lines

        env = self.device().visible_devices_env
        return env_lines(env) if env else []

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def describe(self) -> dict[str, Any]:
        avail = self.availability()
        info: dict[str, Any] = {"name": self.name, "priority": self.priority}
        try:
            info.update(self.device().describe())
        except Exception as exc:
            info.update({"available": False, "reason": f"probe failed: {exc}", "device_count": 0})
        info["available"] = avail.available
        info["reason"] = avail.reason
        info["capabilities"] = sorted(self.capabilities)
        return info
