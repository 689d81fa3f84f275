"""Where images come from: the embedded digits and ImageFolder roots, each split into a train and a held-out
part. A source holds labels in memory and decodes one image at a time (``load(i)`` -> uint8 ``[C, H, W]``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from crosstrain.errors import ConfigError
from crosstrain.plugins.vision.config import VisionSection

#: image file types ImageFolder sources read (Pillow decodes them)
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
#: held-out digits: 368 of 1,797 (20%, stratified; 23 x 16, so the default batch of 16 covers them on 1 or 2 ranks),
#: chosen once with this seed, whatever train.seed is
DIGITS_HELD_OUT, DIGITS_SPLIT_SEED = 368, 0


@dataclass
class ArraySource:
    """Images already decoded in memory (uint8 ``[N, C, H, W]``)."""

    images: torch.Tensor
    labels: np.ndarray
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, i: int) -> torch.Tensor:
        return self.images[i]

    def load_many(self, indices: np.ndarray) -> torch.Tensor:
        return self.images[torch.from_numpy(np.asarray(indices, dtype=np.int64))]

    def subset(self, keep: np.ndarray) -> ArraySource:
        return ArraySource(self.images[keep], self.labels[keep], self.classes)


@dataclass
class FileSource:
    """Image files decoded on demand (Pillow) as ``channels`` channels."""

    paths: list[str]
    labels: np.ndarray
    classes: list[str]
    channels: int = 3

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, i: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.paths[i]) as img:
            pixels = np.asarray(img.convert("L" if self.channels == 1 else "RGB"))
        return torch.from_numpy(pixels.copy()).reshape(*pixels.shape[:2], -1).permute(2, 0, 1).contiguous()

    def load_many(self, indices: np.ndarray) -> torch.Tensor:
        return torch.stack([self.load(int(i)) for i in indices])

    def subset(self, keep: np.ndarray) -> FileSource:
        return FileSource([self.paths[i] for i in keep], self.labels[keep], self.classes, self.channels)


Source = ArraySource | FileSource


def digits(channels: int = 0) -> tuple[ArraySource, ArraySource]:
    """scikit-learn's bundled handwritten digits (1,797 8x8 scans of 16 grey levels, no download), scaled to
    uint8, split into 1,429 training and 368 held-out images (stratified, fixed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = torch.from_numpy(np.round(data.images * (255.0 / 16.0)).astype(np.uint8)).unsqueeze(1)
    if channels == 3:
        images = images.expand(-1, 3, -1, -1).contiguous()
    labels = data.target.astype(np.int64)
    train, held = train_test_split(np.arange(len(labels)), test_size=DIGITS_HELD_OUT, stratify=labels,
                                   random_state=DIGITS_SPLIT_SEED)
    source = ArraySource(images, labels, [str(c) for c in range(10)])
    return source.subset(np.sort(train)), source.subset(np.sort(held))


def _scan(root: Path, classes: list[str] | None = None) -> tuple[list[str], np.ndarray, list[str]]:
    """ImageFolder's convention: one folder per class, classes sorted by name, files sorted by path."""
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    classes = classes if classes is not None else found
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ConfigError(f"vision.data: {root} has class folder {unknown[0]!r}, which train/ lacks; give both "
                          "splits the same class folders")
    paths, labels = [], []
    for label, name in enumerate(classes):
        folder = root / name
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS) if folder.is_dir() else []
        paths += [str(p) for p in files]
        labels += [label] * len(files)
    if not paths:
        raise ConfigError(f"vision.data: no images ({', '.join(EXTENSIONS)}) under {root}/<class>/; point "
                          "vision.data at an ImageFolder root")
    return paths, np.asarray(labels, dtype=np.int64), classes


def image_folder(root: str, val_fraction: float, channels: int = 0) -> tuple[FileSource, FileSource]:
    """``root/train`` and ``root/val`` (or ``root`` itself, ``val_fraction`` of each class held out, fixed)."""
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"vision.data={root!r} is not a folder; give an ImageFolder root (ROOT/<class>/*.png or "
                          "ROOT/train/<class>/*.png + ROOT/val/<class>/*.png), or \"\" for the embedded digits")
    channels = channels or 3
    if (base / "train").is_dir() and (base / "val").is_dir():
        paths, labels, classes = _scan(base / "train")
        vpaths, vlabels, _ = _scan(base / "val", classes)
        return FileSource(paths, labels, classes, channels), FileSource(vpaths, vlabels, classes, channels)
    paths, labels, classes = _scan(base)
    held = held_out_indices(labels, val_fraction)
    keep = np.setdiff1d(np.arange(len(labels)), held)
    source = FileSource(paths, labels, classes, channels)
    return source.subset(keep), source.subset(held)


def held_out_indices(labels: np.ndarray, fraction: float) -> np.ndarray:
    """The last ``round(fraction * n_c)`` files (at least one when a class has two) of each class."""
    out = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = int(round(fraction * len(idx))) or (1 if len(idx) > 1 else 0)
        out.append(idx[len(idx) - n:])
    return np.sort(np.concatenate(out))


def build_sources(sec: VisionSection) -> tuple[Source, Source]:
    """The ``[vision]`` section's training and held-out sources."""
    if not sec.data:
        return digits(sec.channels)
    return image_folder(sec.data, sec.val_fraction, sec.channels)
