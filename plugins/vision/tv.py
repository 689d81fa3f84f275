"""torchvision and timm for the vision plugin. Importing ``crosstrain`` made torchvision importable on the CPU build
of torch (:mod:`crosstrain.torchvision_compat`); these accessors also work when torchvision was imported first."""

from __future__ import annotations

from types import ModuleType

from crosstrain.torchvision_compat import define_missing_ops, fallback_active


def torchvision() -> ModuleType:
    """The torchvision module (with ``torchvision.ops.nms`` usable where its compiled ops did not load)."""
    define_missing_ops()
    import torchvision as tv
    import torchvision.ops.boxes

    if fallback_active():  # torchvision checks for its extension before nms; the fallback kernel is registered
        torchvision.ops.boxes._assert_has_ops = _ops_registered  # type: ignore[attr-defined]
    return tv


def _ops_registered() -> None:
    """torchvision's ``_assert_has_ops`` where the fallback nms is registered: nothing to check. A ``def``, not a
    lambda: tracing a detector for ONNX scripts ``batched_nms`` (``_script_if_tracing``), and TorchScript compiles
    what it calls from the function's source, which a lambda inside an assignment does not give it."""


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
