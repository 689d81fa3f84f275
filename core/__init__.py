"""crosstrain: one training framework, hardware support as a plug-in.

The core defines four interfaces (:mod:`crosstrain.device`, :mod:`crosstrain.collective`,
:mod:`crosstrain.kernels`, :mod:`crosstrain.checkpoint`) and the engine that uses only them. Backends and
plugins register through pluggy under the ``crosstrain`` entry-point group.
"""

from __future__ import annotations

from crosstrain import torchvision_compat
from crosstrain.hookspecs import hookimpl

torchvision_compat.install()  # torchvision imports on the CPU build of torch (transformers imports it)

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
