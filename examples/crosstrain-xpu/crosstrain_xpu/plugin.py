"""Entry point module: registers the XPU backend with crosstrain through pluggy."""

from __future__ import annotations

from crosstrain import hookimpl


@hookimpl
def crosstrain_register_backends():
    from crosstrain_xpu.backend import XpuBackend

    return [XpuBackend()]
