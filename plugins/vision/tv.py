"""Import torchvision (and timm, which imports it) on a CPU build of torch.

PyPI's Linux torchvision wheels are built against the CUDA build of torch: on the CPU build
(``requirements/cpu.txt``) their C++ extension does not load (it needs ``libtorch_cuda.so``), and torchvision
0.28's ``_meta_registrations`` then fails at import, registering a fake kernel for ``torchvision::nms``, an
operator that was never defined. Defining the two operators' schemas first lets the pure-Python parts import
(transforms.v2, models, ops.boxes' arithmetic); the C++ operators themselves stay unavailable, as torchvision
reports when one is called. Where the extension loads, nothing is defined here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

_LIB: Any = None


def _define_missing_ops() -> None:
    global _LIB
    if _LIB is not None or hasattr(torch.ops.torchvision, "nms"):
        return
    try:  # torchvision's extension registers the operators when it loads; then there is nothing to do
        import importlib.util

        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return
        from pathlib import Path

        so = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
        if so is not None:
            torch.ops.load_library(str(so))
            return
    except OSError:
        pass
    _LIB = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _LIB.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def torchvision() -> ModuleType:
    """The torchvision module, importable on the CPU build of torch (module docstring)."""
    _define_missing_ops()
    import torchvision as tv

    return tv


def timm() -> ModuleType:
    """The timm module (it imports torchvision)."""
    _define_missing_ops()
    import timm as tm

    return tm


def v2() -> ModuleType:
    """``torchvision.transforms.v2``."""
    _define_missing_ops()
    from torchvision.transforms import v2 as transforms

    return transforms
