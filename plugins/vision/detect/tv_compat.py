"""torchvision where its compiled ops cannot load: a pure-torch ``torchvision::nms`` in their place.

PyPI's torchvision wheels for Linux x86-64 are CUDA builds. Beside the CPU build of torch that
requirements/cpu.txt pins, their ``_C`` extension does not load (it links ``libtorch_cuda.so``), and torchvision
0.28 then fails at import with "operator torchvision::nms does not exist" (its fake-tensor registration of
``nms`` runs whether the ops loaded or not). The detectors this recipe builds (FCOS, RetinaNet) need one compiled
op, ``nms``; where ``_C`` loads (a matching torch + torchvision pair), nothing here runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_LIB: Any = None  # the torch.library fragment must outlive this call, or its ops are unregistered


def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression as torchvision's CPU kernel computes it: boxes (xyxy) by descending score;
    a box is dropped when its IoU with a kept, higher-scoring box exceeds ``iou_threshold``. Returns the kept
    indices (int64), highest score first."""
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


def _extension_loads() -> bool:
    """Whether torchvision's compiled ops load beside this torch (checked without importing torchvision)."""
    if "torchvision" in sys.modules:
        return bool(sys.modules["torchvision"].extension._has_ops())
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("_C.*"))
    try:
        torch.ops.load_library(str(found[0]))
    except (IndexError, OSError):
        return False
    return True


def import_torchvision() -> Any:
    """``import torchvision``, with :func:`nms` registered as ``torchvision::nms`` when its ops cannot load."""
    global _LIB
    if "torchvision" in sys.modules or _LIB is not None or _extension_loads():
        import torchvision

        return torchvision
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):  # torchvision registers fake kernels for both at import
        _LIB.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.impl("nms", nms, "CompositeExplicitAutograd")
    import torchvision
    import torchvision.ops.boxes

    torchvision.ops.boxes._assert_has_ops = lambda: None  # type: ignore[attr-defined]  # nms is defined now
    return torchvision
