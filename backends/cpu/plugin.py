"""Entry point of the CPU backend (``[project.entry-points.crosstrain] cpu = ...``)."""

from __future__ import annotations

from crosstrain import hookimpl
from crosstrain.backend import Backend


@hookimpl
def crosstrain_register_backends() -> list[Backend]:
    from crosstrain.backends.cpu.backend import CpuBackend

    return [CpuBackend()]
