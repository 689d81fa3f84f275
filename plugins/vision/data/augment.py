"""Augmentation from TOML through torchvision.transforms.v2, applied with a seed per sample.

``vision.augment`` is a list of tables ``{name = "<v2 class>", <arguments>}`` built in order into a
``v2.Compose``. Each sample is transformed with torch's CPU generator seeded by :func:`sample_seed`, so the
pixels of sample ``i`` in epoch ``e`` depend only on ``(train.seed, e, i)``: the same after a resume, on any
number of ranks or workers, and the run's own RNG stream is left as it was (:func:`rng_restored`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from crosstrain.errors import ConfigError

_MASK = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014): a well-mixed 64-bit hash of ``z``."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sample_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """A 63-bit seed from ``(seed, epoch, index, stream)``: SplitMix64 chained over the four values (stable across
    runs, platforms and Python versions, unlike ``hash``)."""
    z = 0
    for v in (seed, epoch, index, stream):
        z = _splitmix64(z ^ (v & _MASK))
    return z >> 1


def build_transform(specs: list[dict[str, Any]], image_size: int = 0, key: str = "vision.augment") -> Any:
    """``v2.Compose`` of the tables in ``specs`` (after a resize to ``image_size`` unless one of them crops to a size
    itself); each a one-line ConfigError naming the table (``key[i]``) when its class or arguments are wrong. The
    same for ``classify`` (images) and ``detect`` (images with their boxes: v2 transforms are box-aware)."""
    from crosstrain.plugins.vision.tv import v2 as transforms

    v2 = transforms()
    steps = []
    sized = any(s.get("name") in ("RandomResizedCrop", "Resize", "CenterCrop", "RandomCrop") for s in specs)
    if image_size and not sized:
        steps.append(v2.Resize((image_size, image_size), antialias=True))
    for i, spec in enumerate(specs):
        args = dict(spec)
        name = args.pop("name", None)
        cls = getattr(v2, str(name), None) if name else None
        if not isinstance(cls, type) or not issubclass(cls, v2.Transform):
            raise ConfigError(f"{key}[{i}]: {name!r} is not a torchvision.transforms.v2 transform; give "
                              'name = "RandomHorizontalFlip", "ColorJitter", "RandomResizedCrop", "RandAugment", ...')
        if name in ("MixUp", "CutMix"):
            raise ConfigError(f"{key}[{i}]: {name} mixes two images; set vision.mixup_alpha / vision.cutmix_alpha "
                              "instead (classify)")
        try:
            steps.append(cls(**args))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}[{i}] ({name}): {exc}; fix the table's arguments") from None
    return v2.Compose(steps) if steps else v2.Identity()


def eval_transform(image_size: int) -> Any:
    """The held-out images: resized (shorter side) and centre-cropped to ``image_size``, or kept as they are."""
    from crosstrain.plugins.vision.tv import v2 as transforms

    v2 = transforms()
    if not image_size:
        return v2.Identity()
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


@contextlib.contextmanager
def rng_restored() -> Iterator[None]:
    """Restore torch's CPU RNG state on leaving (:func:`seeded` calls inside it reseed it): the loop's own random
    stream, checkpointed with the run, does not move. Cheaper than ``torch.random.fork_rng`` per sample."""
    state = torch.default_generator.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


def seeded(transform: Any, inputs: Any, seed: int) -> Any:
    """``transform(inputs)`` with torch's CPU generator seeded by ``seed`` (the v2 transforms draw from it); call
    inside :func:`rng_restored`."""
    torch.default_generator.manual_seed(seed)
    return transform(inputs)


def normalize(images: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` -> float32 ``(x / 255 - mean) / std`` per channel (0.5 each when not given)."""
    c = images.shape[1]
    m = torch.tensor(mean or [0.5] * c, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std or [0.5] * c, dtype=torch.float32).view(1, -1, 1, 1)
    if m.numel() != c or s.numel() != c:
        raise ConfigError(f"vision.mean/std have {m.numel()}/{s.numel()} values for {c}-channel images; give {c} "
                          "each (or none)")
    return (images.float() / 255.0 - m) / s
