"""The kernel registry: named ops with a reference implementation, and faster per-backend kernels.

Dispatch picks, for the device type of the first tensor argument and the active backend, the
registered implementation with the highest priority whose ``supports`` predicate accepts the inputs;
otherwise the reference. ``CROSSTRAIN_KERNELS=reference`` (or config ``kernels = "reference"``) forces
the reference everywhere; ONNX export always traces the reference.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from crosstrain.errors import KernelError

ENV_KERNELS = "CROSSTRAIN_KERNELS"
MODES = ("auto", "reference")


@dataclass(frozen=True)
class OpSpec:
    """A declared op: its name, its reference implementation and a one-line description."""

    name: str
    reference: Callable[..., Any]
    doc: str = ""

    @property
    def signature(self) -> str:
        """The reference's parameters and result, e.g. ``(x: Tensor, weight: Tensor, eps: float = 1e-06) -> Tensor``:
        what every registered implementation of the op must accept and return."""
        text = str(inspect.signature(self.reference)).replace("'", "")  # postponed annotations are strings
        return text.replace("torch.", "")


@dataclass(frozen=True)
class KernelImpl:
    """One backend's implementation of an op on one torch device type."""

    op: str
    fn: Callable[..., Any]
    backend: str
    device_type: str
    priority: int = 0
    supports: Callable[..., bool] | None = None
    label: str = ""

    def accepts(self, args: tuple, kwargs: dict) -> bool:
        return self.supports is None or bool(self.supports(*args, **kwargs))


def _waited(arg: Any) -> Any:
    """A collective's pending result (tensor parallelism's all-reduced embedding output) as a plain tensor, so it
    gets the kernel one process gives the same values: predicates send tensor subclasses to the reference, whose
    rounding differs from a native kernel's by 1e-7, and fake quantisation turns such a difference into a whole
    grid step (the layout x feature matrix's qat x tp cells). A copy, not ``.wait()``: the gradient does not flow
    back through ``wait_tensor`` (measured: the embedding's gradient lost)."""
    return arg.clone() if _PENDING is not None and isinstance(arg, _PENDING) else arg


try:  # torch built without distributed has no pending collectives
    from torch.distributed._functional_collectives import AsyncCollectiveTensor as _PENDING
except ImportError:  # pragma: no cover
    _PENDING = None  # type: ignore[assignment,misc]


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


class KernelRegistry:
    """Holds op declarations and implementations; thread-safe for registration, lock-free to dispatch."""

    def __init__(self) -> None:
        self._ops: dict[str, OpSpec] = {}
        self._impls: dict[str, list[KernelImpl]] = {}
        self._lock = threading.Lock()
        self.active_backend: str | None = None
        self.active_device_type: str | None = None
        self._mode = self._mode_from_env()
        self._populated = False

    @staticmethod
    def _mode_from_env() -> str:
        mode = os.environ.get(ENV_KERNELS, "auto").strip().lower() or "auto"
        if mode not in MODES:
            raise KernelError(f"{ENV_KERNELS}={mode!r} is not allowed; use one of {', '.join(MODES)}")
        return mode

    # -- declaration and registration -------------------------------------------------------------
    def declare(self, name: str, reference: Callable[..., Any], doc: str = "") -> None:
        """Declare op ``name`` with its differentiable reference implementation."""
        with self._lock:
            if name in self._ops and self._ops[name].reference is not reference:
                raise KernelError(f"op {name!r} is already declared with another reference implementation")
            self._ops[name] = OpSpec(name, reference, doc)
            self._impls.setdefault(name, [])

    def register(
        self,
        op: str,
        fn: Callable[..., Any],
        *,
        backend: str,
        device_type: str,
        priority: int = 0,
        supports: Callable[..., bool] | None = None,
        label: str = "",
    ) -> None:
        """Register ``fn`` as ``backend``'s implementation of ``op`` for tensors on ``device_type``."""
        self._ensure_populated()
        with self._lock:
            if op not in self._ops:
                raise KernelError(self._unknown(op))
            impls = [i for i in self._impls[op] if not (i.backend == backend and i.label == label)]
            impls.append(KernelImpl(op, fn, backend, device_type, priority, supports, label or fn.__name__))
            impls.sort(key=lambda i: -i.priority)
            self._impls[op] = impls

    # -- queries ----------------------------------------------------------------------------------
    def ops(self) -> dict[str, OpSpec]:
        self._ensure_populated()
        return dict(self._ops)

    def impls(self, op: str) -> list[KernelImpl]:
        self._ensure_populated()
        if op not in self._ops:
            raise KernelError(self._unknown(op))
        return list(self._impls[op])

    def reference(self, op: str) -> Callable[..., Any]:
        self._ensure_populated()
        spec = self._ops.get(op)
        if spec is None:
            raise KernelError(self._unknown(op))
        return spec.reference

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise KernelError(f"kernels mode {mode!r} is not allowed; use one of {', '.join(MODES)}")
        self._mode = mode

    def set_active_backend(self, name: str | None, device_type: str | None = None) -> None:
        """Prefer ``name``'s kernels for tensors on ``device_type`` (other device types keep their own)."""
        self.active_backend = name
        self.active_device_type = device_type

    @contextmanager
    def use_reference(self) -> Iterator[None]:
        """Force the reference path inside the block (export, debugging, parity tests)."""
        previous = self._mode
        self._mode = "reference"
        try:
            yield
        finally:
            self._mode = previous

    # -- dispatch ---------------------------------------------------------------------------------
    def resolve(self, op: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """The implementation that :meth:`call` would run for these arguments."""
        self._ensure_populated()
        spec = self._ops.get(op)
        if spec is None:
            raise KernelError(self._unknown(op))
        if self._mode == "reference" or torch.onnx.is_in_onnx_export():
            return spec.reference
        tensor = _first_tensor(args)
        if tensor is None:
            return spec.reference
        device_type = tensor.device.type
        # On the active backend's device type only its own kernels apply (cuda and rocm share "cuda");
        # tensors on another device type (e.g. host tensors of an offloaded optimizer) use that type's kernels.
        exclusive = self.active_backend is not None and device_type == self.active_device_type
        for impl in self._impls[op]:
            if impl.device_type != device_type:
                continue
            if exclusive and impl.backend != self.active_backend:
                continue
            if impl.accepts(args, kwargs):
                return impl.fn
        return spec.reference

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        args = self.plain_args(*args)
        return self.resolve(op, *args, **kwargs)(*args, **kwargs)

    @staticmethod
    def plain_args(*args: Any) -> tuple[Any, ...]:
        """``args`` as :meth:`call` hands them to a kernel (pending collectives as plain tensors): a caller that
        resolves an implementation itself passes them through this first, so it gets the kernel ``call`` would."""
        return tuple(_waited(a) for a in args)

    # -- population -------------------------------------------------------------------------------
    def _unknown(self, op: str) -> str:
        known = ", ".join(sorted(self._ops)) or "none"
        return f"unknown kernel op {op!r}; declared ops: {known}"

    def _ensure_populated(self) -> None:
        if self._populated:
            return
        self._populated = True
        from crosstrain import pluginmanager as plugins
        from crosstrain import registry as backend_registry
        from crosstrain.kernels.reference import CORE_OPS

        for name, (fn, doc) in CORE_OPS.items():
            self.declare(name, fn, doc)
        for backend in backend_registry.backends().values():
            try:
                backend.register_kernels(self)
            except Exception as exc:
                plugins.record_error(backend.name, exc)

    def reset(self) -> None:
        """Drop every registration; the next use re-declares the core ops and re-asks the plugins."""
        with self._lock:
            self._ops.clear()
            self._impls.clear()
            self._populated = False
            self._mode = self._mode_from_env()


registry = KernelRegistry()
