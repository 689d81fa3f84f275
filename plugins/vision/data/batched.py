"""The trailing ``RandomAffine`` steps of an augmentation applied to a whole batch at once, each image with its own
parameters, giving the pixels of the per-sample path exactly.

Per sample, torch's generator is seeded as :func:`~.augment.seeded` does, the steps before the affine ones run on the
image, and each affine step's parameters are drawn by its own ``make_params`` in the order ``v2.Compose`` would draw
them. The images then go through torchvision's affine kernel once per step: the inverse matrix of each image as
``affine_image`` builds it, the grids of all images in one ``bmm`` (the same product torchvision's ``_affine_grid``
takes for one), and one ``grid_sample`` with the fill mask (torchvision's ``_apply_grid_transform``). ``grid_sample``
computes each output pixel from its own grid point alone, so a batch gives each image's pixels bit for bit
(tests/test_vision_parts.py checks it against the v2 transform). The per-sample v2 call is ~0.12 ms of Python an
image: ~1.9 ms of a 16-image step of the digits CNN, ~0.6 ms batched (docs/vision.md).

Where torchvision's private kernel helpers are missing (another version), nothing is batched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch


@functools.cache
def _kernels() -> SimpleNamespace | None:
    """torchvision's private helpers of its affine kernel, or None where this torchvision has moved them."""
    from crosstrain.plugins.vision.tv import v2

    v2()  # torchvision importable (crosstrain.torchvision_compat)
    try:
        from torchvision.transforms.functional import _get_inverse_affine_matrix
        from torchvision.transforms.v2._utils import _get_fill
        from torchvision.transforms.v2.functional._geometry import (
            _affine_parse_args,
            _apply_grid_transform,
            _check_interpolation,
        )
    except ImportError:  # pragma: no cover - another torchvision: the per-sample path
        return None
    return SimpleNamespace(inverse=_get_inverse_affine_matrix, fill=_get_fill, parse=_affine_parse_args,
                           grid_transform=_apply_grid_transform, interpolation=_check_interpolation)


def _k() -> SimpleNamespace:
    k = _kernels()
    assert k is not None  # split_affine_tail batches nothing without them
    return k


#: interpolations ``grid_sample`` does per pixel (torchvision's tensor kernel refuses the others)
_GRID_MODES = ("nearest", "bilinear")


def split_affine_tail(transform: Any) -> tuple[Callable[[Any], Any] | None, list[Any]] | None:
    """``(prefix, affines)``: the steps of a ``v2.Compose`` before its trailing run of ``v2.RandomAffine`` steps (None
    when there are none) and that run; None when the transform does not end with one the batch kernel applies."""
    from crosstrain.plugins.vision.tv import v2 as transforms

    v2 = transforms()
    if _kernels() is None or not isinstance(transform, v2.Compose):
        return None
    steps = list(transform.transforms)
    k = len(steps)
    while k and type(steps[k - 1]) is v2.RandomAffine and _mode(steps[k - 1]) in _GRID_MODES:
        k -= 1
    if k == len(steps):
        return None
    return (v2.Compose(steps[:k]) if k else None), steps[k:]


def _mode(step: Any) -> str:
    return str(_k().interpolation(step.interpolation).value)


def draw(prefix: Callable[[Any], Any] | None, affines: Sequence[Any], image: torch.Tensor,
         seed: int) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """One sample: the prefix's output and each affine step's parameters, drawn from torch's generator seeded with
    ``seed`` in ``v2.Compose``'s order (call inside :func:`~.augment.rng_restored`)."""
    torch.default_generator.manual_seed(seed)
    if prefix is not None:
        image = prefix(image)
    return image, [step.make_params([image]) for step in affines]


def _inverse_matrix(step: Any, params: dict[str, Any], width: int, height: int) -> list[float]:
    """The inverse affine matrix torchvision's ``affine_image`` samples with, for one image's parameters."""
    k = _k()
    angle, translate, shear, center = k.parse(params["angle"], params["translate"], params["scale"], params["shear"],
                                              k.interpolation(step.interpolation), step.center)
    center_f = [0.0, 0.0] if center is None else [c - s * 0.5 for c, s in zip(center, [width, height], strict=True)]
    return k.inverse(center_f, angle, [float(t) for t in translate], params["scale"], shear)


def _grids(theta: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """torchvision's ``_affine_grid`` (output size = input size) for ``theta`` ``[B, 2, 3]``: the same base grid
    and the same ``bmm``, over the batch."""
    b = theta.shape[0]
    base = torch.empty(1, height, width, 3, dtype=theta.dtype)
    base[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, steps=width))
    base[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, steps=height).unsqueeze_(-1))
    base[..., 2].fill_(1)
    rescaled = theta.transpose(1, 2).div_(torch.tensor([0.5 * width, 0.5 * height], dtype=theta.dtype))
    return base.view(1, height * width, 3).expand(b, -1, -1).bmm(rescaled).view(b, height, width, 2)


def apply_affine(step: Any, images: torch.Tensor, params: Sequence[dict[str, Any]]) -> torch.Tensor:
    """``step`` (a ``v2.RandomAffine``) on ``images`` ``[B, C, H, W]``, image ``b`` with ``params[b]``: what
    ``step.transform(images[b], params[b])`` gives for each ``b``."""
    height, width = images.shape[-2:]
    dtype = images.dtype if torch.is_floating_point(images) else torch.float32
    theta = torch.tensor([_inverse_matrix(step, p, width, height) for p in params], dtype=dtype).view(-1, 2, 3)
    k = _k()
    fill = k.fill(step._fill, torch.Tensor)  # a plain tensor's fill: augment_batch batches only plain tensors
    return k.grid_transform(images, _grids(theta, width, height), _mode(step), fill=fill)


def augment_batch(prefix: Callable[[Any], Any] | None, affines: Sequence[Any], images: Sequence[torch.Tensor],
                  seeds: Sequence[int]) -> list[torch.Tensor]:
    """Each image of ``images`` augmented with its seed, as ``seeded(Compose([*prefix, *affines]), image, seed)``
    gives it; the affine steps run once for the batch when the prefix's outputs are plain ``[C, H, W]`` tensors of one
    shape and dtype, else per image with the same parameters (call inside :func:`~.augment.rng_restored`)."""
    drawn = [draw(prefix, affines, img, s) for img, s in zip(images, seeds, strict=True)]
    out = [img for img, _ in drawn]
    first = out[0]
    if any(type(x) is not torch.Tensor or x.shape != first.shape or x.dtype != first.dtype or x.dim() != 3
           for x in out):
        for j, step in enumerate(affines):
            out = [step.transform(x, p[j]) for x, (_, p) in zip(out, drawn, strict=True)]
        return out
    batch = torch.stack(out)
    for j, step in enumerate(affines):
        batch = apply_affine(step, batch, [p[j] for _, p in drawn])
    return list(batch.unbind(0))
