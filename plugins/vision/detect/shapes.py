"""The embedded default data of ``--recipe detect``: seeded synthetic shapes, written once in COCO format.

Each image is ``size x size`` RGB: a noisy random background with 1-3 filled, non-overlapping shapes (circle,
square, triangle: the three categories) of random size, colour and position. The same seed writes the same pixels
and boxes, so a run on the embedded data is reproducible anywhere. Layout (COCO, as
``torchvision.datasets.CocoDetection`` reads it): ``<root>/<split>/NNNNN.png`` and ``<root>/<split>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

CATEGORIES = ("circle", "square", "triangle")
#: bumped when :func:`render` changes, so a cached folder is never read as another generator's output
GENERATOR = 1


def _shape_mask(kind: int, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """A boolean ``size x size`` mask of one shape centred at ``(cx, cy)`` with half-extent ``r``."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    if kind == 0:
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if kind == 1:
        return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    # an upright isosceles triangle inside the box [cx-r, cx+r] x [cy-r, cy+r]
    t = (yy - (cy - r)) / (2 * r)  # 0 at the apex, 1 at the base
    return (t >= 0) & (t <= 1) & (np.abs(xx - cx) <= t * r)


def render(rng: np.random.Generator, size: int) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One image (``uint8 [size, size, 3]``) and its objects (``bbox`` in COCO's ``[x, y, w, h]``,
    ``category_id`` 1-3). Shapes do not overlap (a hidden object could not be found, capping any detector's AP):
    a placement that would touch an earlier shape's box is drawn again, and dropped after 20 tries."""
    base = rng.uniform(0, 255, size=3)
    image = np.clip(base + rng.normal(0, 20, size=(size, size, 3)), 0, 255)
    objects: list[dict[str, Any]] = []
    taken: list[tuple[float, float, float, float]] = []
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 3))
        r = float(rng.uniform(size * 0.12, size * 0.3))
        for _try in range(20):
            cx, cy = (float(v) for v in rng.uniform(r, size - r, size=2))
            if all(cx + r + 1 < x0 or cx - r - 1 > x1 or cy + r + 1 < y0 or cy - r - 1 > y1
                   for x0, y0, x1, y1 in taken):
                break
        else:
            continue
        colour = rng.uniform(0, 255, size=3)
        while np.abs(colour - base).max() < 80:  # keep every shape visible against the background
            colour = rng.uniform(0, 255, size=3)
        mask = _shape_mask(kind, cx, cy, r, size)
        image[mask] = colour
        ys, xs = np.nonzero(mask)
        x0, y0, x1, y1 = float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)
        taken.append((x0, y0, x1, y1))
        objects.append({"bbox": [x0, y0, x1 - x0, y1 - y0], "category_id": kind + 1, "area": float(mask.sum())})
    return image.astype(np.uint8), objects


def write_split(folder: Path, split: str, count: int, size: int, seed: int) -> None:
    """Write ``count`` images of ``split`` into ``folder/split/`` and their annotations to ``folder/split.json``."""
    from PIL import Image

    rng = np.random.default_rng([seed, {"train": 0, "val": 1}[split]])
    (folder / split).mkdir(parents=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for i in range(count):
        pixels, objects = render(rng, size)
        name = f"{i:05d}.png"
        Image.fromarray(pixels).save(folder / split / name)
        images.append({"id": i + 1, "file_name": name, "width": size, "height": size})
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "iscrowd": 0, **obj})
    coco = {"images": images, "annotations": annotations,
            "categories": [{"id": k + 1, "name": n} for k, n in enumerate(CATEGORIES)]}
    (folder / f"{split}.json").write_text(json.dumps(coco))


def ensure_shapes(root: Path, *, train: int, val: int, size: int, seed: int) -> Path:
    """The shapes dataset's folder ``root/shapes-g{GENERATOR}-s{seed}-{size}px-{train}-{val}``, written on first use.

    Written into a temporary folder and renamed into place, so concurrent first runs (the ranks of one job,
    two jobs) never read a half-written dataset: the first rename wins, the others drop their copy.
    """
    folder = Path(root) / f"shapes-g{GENERATOR}-s{seed}-{size}px-{train}-{val}"
    if folder.is_dir():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_split(tmp, "train", train, size, seed)
    write_split(tmp, "val", val, size, seed)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process renamed its identical copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
