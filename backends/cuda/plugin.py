"""Entry point of the CUDA backend (``[project.entry-points.crosstrain] cuda = ...``)."""

from __future__ import annotations

from crosstrain import hookimpl
from crosstrain.backend import Backend


@hookimpl
def crosstrain_register_backends() -> list[Backend]:
    from crosstrain.backends.cuda.backend import CudaBackend

    return [CudaBackend()]
