"""Entry point of the simdev software device (``[project.entry-points.crosstrain] simdev = ...``)."""

from __future__ import annotations

from crosstrain import hookimpl
from crosstrain.backend import Backend


@hookimpl
def crosstrain_register_backends() -> list[Backend]:
    from crosstrain.backends.simdev.backend import SimdevBackend

    return [SimdevBackend()]
