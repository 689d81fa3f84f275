"""The CPU reference backend: the one CI runs, and the fallback every machine has."""

from __future__ import annotations

from typing import Any

import torch

from crosstrain.backend import Backend
from crosstrain.backends.cpu.device import CpuDevice
from crosstrain.device import Device
from crosstrain.kernels import KernelRegistry


class CpuBackend(Backend):
    name = "cpu"
    priority = 0
    capabilities = frozenset({"bf16", "fp16"})
    install_hint = "cpu"

    def make_device(self) -> Device:
        return CpuDevice()

    def doctor_lines(self) -> list[tuple[str, str]]:
        from crosstrain.backends.cpu import native
        from crosstrain.backends.cpu.native import kernels

        # Without the extensions the fused optimizer steps and the model ops fall back to the (slower) references.
        built = "built" if native.available() else "not built (optimizer steps use the references)"
        ops = f"built ({kernels.isa()})" if kernels.available() else "not built (model ops use the references)"
        return [("native CPU optimizer", built), ("native CPU kernels", ops)]

    def fast_optimizer(self, name: str, groups: list[dict[str, Any]], hyper: dict[str, Any]
                       ) -> tuple[torch.optim.Optimizer, str] | None:
        # The native fused step (benchmarks/optimizer.py: ~3x torch's fused AdamW on the host); without the
        # extension its reference step is slower than torch's, so plain torch.optim is used instead.
        from crosstrain.backends.cpu import native

        if not native.available():
            return None
        from crosstrain.backends.cpu.native.optim import FusedAdamW, FusedSGD

        if name == "adamw":
            return FusedAdamW(groups, **hyper), "native"
        if name == "sgd":
            return FusedSGD(groups, **hyper), "native"
        return None

    def register_kernels(self, registry: KernelRegistry) -> None:
        # The native fused optimizer steps (_C) and model ops (_kernels), each when its extension is built;
        # everything else, and everything when one is missing, runs the references.
        from crosstrain.backends.cpu.native import kernels, register

        register(registry, backend=self.name)
        kernels.register(registry, backend=self.name)
