"""Entry point of the ROCm backend (``[project.entry-points.crosstrain] rocm = ...``)."""

from __future__ import annotations

from crosstrain import hookimpl
from crosstrain.backend import Backend


@hookimpl
def crosstrain_register_backends() -> list[Backend]:
    from crosstrain.backends.rocm.backend import RocmBackend

    return [RocmBackend()]
