"""torchvision and timm for the vision plugin. Importing ``crosstrain`` made torchvision importable on the CPU build
of torch (:mod:`crosstrain.torchvision_compat`); these accessors also work when torchvision was imported first."""

from __future__ import annotations

from types import ModuleType

from crosstrain.torchvision_compat import define_missing_ops


def torchvision() -> ModuleType:
    """The torchvision module."""
    define_missing_ops()
    import torchvision as tv

    return tv


def timm() -> ModuleType:
    """The timm module (it imports torchvision)."""
    define_missing_ops()
    import timm as tm

    return tm


def v2() -> ModuleType:
    """``torchvision.transforms.v2``."""
    define_missing_ops()
    from torchvision.transforms import v2 as transforms

    return transforms
