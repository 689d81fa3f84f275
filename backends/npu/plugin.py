"""Entry point of the Ascend NPU backend (``[project.entry-points.crosstrain] npu = ...``)."""

from __future__ import annotations

from crosstrain import hookimpl
from crosstrain.backend import Backend


@hookimpl
def crosstrain_register_backends() -> list[Backend]:
    from crosstrain.backends.npu.backend import NpuBackend

    return [NpuBackend()]
