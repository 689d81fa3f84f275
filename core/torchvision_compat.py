"""Let torchvision import on the CPU build of torch, in every crosstrain process.

PyPI's Linux torchvision wheels are built against the CUDA build of torch: on the CPU build
(``requirements/cpu.txt``) their C++ extension does not load (it needs ``libtorch_cuda.so``), and torchvision's
``_meta_registrations`` then fails at import, registering a fake kernel for ``torchvision::nms``, an operator never
defined. Anything that imports torchvision fails with it, transformers' configs included (they import its
transforms). :func:`install` (run when ``crosstrain`` is imported) adds an import hook that, the first time
torchvision is imported, defines the two operator schemas its import registers (``nms``, ``qnms``) when the
extension cannot provide them: the pure-Python parts (transforms.v2, models) then work, and the C++ operators stay
unavailable, as torchvision reports when one is called, except ``nms``, which FCOS/RetinaNet need at run time
(``--recipe detect``) and which gets the pure-torch kernel :func:`nms`. Where the extension loads, nothing is
defined.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_LIB: Any = None  # the torch.library fragment must outlive define_missing_ops, or its ops are unregistered
_CHECKED = False


def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression as torchvision's CPU kernel computes it: boxes (xyxy) by descending score;
    a box is dropped when its IoU with a kept, higher-scoring box exceeds ``iou_threshold``. Returns the kept
    indices (int64), highest score first."""
    import numpy as np
    import torch

    if dets.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=dets.device)
    order = scores.detach().float().cpu().argsort(descending=True, stable=True)
    b = dets.detach().float().cpu()[order]
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=2)
    over = (inter / (area[:, None] + area[None, :] - inter) > iou_threshold).numpy()
    suppressed = np.zeros(len(b), dtype=bool)
    keep = []
    for i in range(len(b)):
        if not suppressed[i]:
            keep.append(i)
            suppressed |= over[i]
    return order[torch.tensor(keep, dtype=torch.int64)].to(dets.device)


def define_missing_ops() -> None:
    """Define ``torchvision::nms`` / ``qnms`` unless torchvision's extension loads (then it defines them). Once
    per process; the import hook is removed first (``find_spec`` below would run it again)."""
    global _LIB, _CHECKED
    if _CHECKED:
        return
    _CHECKED = True
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    import torch

    if torch._C._jit_get_schemas_for_operator("torchvision::nms"):
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    so = next(Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"), None)
    if so is not None:
        try:
            torch.ops.load_library(str(so))
            return
        except OSError:  # built against another torch (the CUDA build): define the schemas below
            pass
    _LIB = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _LIB.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.impl("nms", nms, "CompositeExplicitAutograd")


def fallback_active() -> bool:
    """Whether :func:`define_missing_ops` defined the ops (torchvision's compiled extension did not load)."""
    return _LIB is not None


class _Finder(importlib.abc.MetaPathFinder):
    """Runs :func:`define_missing_ops` just before torchvision is first imported, then steps aside."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            define_missing_ops()
        return None  # the regular finders import it


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
