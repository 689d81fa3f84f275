"""Detection data: COCO-format JSON + an image folder, decoded and augmented per sample, batched per step.

Samples are addressed by index and drawn by the loop's resumable sampler (its position is in the checkpoint).
A training sample's augmentation (``detect.augment``, torchvision.transforms.v2, box-aware) is seeded by
``(train.seed, step, index)`` and each step's image size (multi-scale training) by ``(train.seed, step)``: a
resumed run sees the same pixels, and every data-parallel layout trains on the same images at the same size.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crosstrain.plugins.vision.tv import torchvision as _torchvision

_torchvision()  # nms usable before torchvision's detection code runs (crosstrain.torchvision_compat)


@dataclass(frozen=True)
class DetectBatch:
    """One micro-batch: ``images`` (float ``[3, H, W]`` in [0, 1], each sized by the pipeline), their ``boxes``
    (``[N, 4]`` xyxy pixels) and ``labels`` (``[N]`` int64 COCO category ids), ``image_ids`` (COCO ids) and
    ``scales`` (original size / fed size, to map predictions back to the annotation's coordinates)."""

    images: list[torch.Tensor]
    boxes: list[torch.Tensor]
    labels: list[torch.Tensor]
    image_ids: torch.Tensor
    scales: torch.Tensor

    def targets(self) -> list[dict[str, torch.Tensor]]:
        """The targets as torchvision's detectors take them."""
        return [{"boxes": b, "labels": lab} for b, lab in zip(self.boxes, self.labels, strict=True)]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b(np.asarray(parts, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CocoSamples:
    """The images and boxes of one COCO instances JSON (``torchvision.datasets.CocoDetection`` wrapped for
    transforms v2: boxes are ``tv_tensors.BoundingBoxes``, crowd boxes left out)."""

    def __init__(self, images: str | Path, annotations: str | Path) -> None:
        from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2

        self.annotations = Path(annotations)
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its loading progress
            base = CocoDetection(str(images), str(annotations))
        self.coco = base.coco
        self.ids = list(base.ids)
        self.categories = sorted(self.coco.getCatIds())
        self.dataset = wrap_dataset_for_transforms_v2(base, target_keys=("image_id", "boxes", "labels"))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Any, dict[str, Any]]:
        from torchvision import tv_tensors

        image, target = self.dataset[i]
        if "boxes" not in target:  # an image without annotations
            h, w = image.height, image.width
            target = {"image_id": target["image_id"], "labels": torch.zeros(0, dtype=torch.int64),
                      "boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w))}
        return image, target


class DetectDataset:
    """Samples of :class:`CocoSamples`, each augmented (training) and resized so its longer side is the batch's
    size; ``step`` says which optimizer step is being drawn (the loop's counter + 1)."""

    def __init__(self, samples: CocoSamples, *, sizes: Sequence[int], seed: int, augment: Any = None,
                 step: Callable[[], int] = lambda: 0) -> None:
        self.samples = samples
        self.sizes = list(sizes)
        self.seed = seed
        self.augment = augment
        self.step = step

    def __len__(self) -> int:
        return len(self.samples)

    def size_at(self, step: int) -> int:
        """The longer image side of step ``step``: one draw per step, the same for every micro-batch and rank."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        return self.sizes[mix_seed(self.seed, step, -1) % len(self.sizes)]

    def sample(self, i: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float]:
        from torchvision.transforms import v2

        image, target = self.samples[int(i)]
        image = v2.functional.to_dtype(v2.functional.to_image(image), torch.float32, scale=True)
        boxes = target["boxes"]
        if self.augment is not None:
            with torch.random.fork_rng(devices=[]):  # the global RNG (dropout, samplers) is left as it was
                torch.manual_seed(mix_seed(self.seed, step, int(i)))
                image, boxes, labels = self.augment(image, boxes, target["labels"])
        else:
            labels = target["labels"]
        h, w = image.shape[-2:]
        scale = size / max(h, w)
        new = [round(h * scale), round(w * scale)]
        image, boxes = v2.functional.resize(image, new), v2.functional.resize(boxes, new)
        keep = ((boxes[:, 2] - boxes[:, 0]) >= 1) & ((boxes[:, 3] - boxes[:, 1]) >= 1)  # boxes a crop or zoom shrank
        return (image.as_subclass(torch.Tensor), boxes.as_subclass(torch.Tensor)[keep], labels[keep],
                int(target["image_id"]), 1.0 / scale)

    def batch(self, indices: Any) -> DetectBatch:
        step = self.step()
        size = self.size_at(step)
        parts = [self.sample(int(i), step, size) for i in np.asarray(indices).reshape(-1)]
        return DetectBatch(images=[p[0] for p in parts], boxes=[p[1] for p in parts], labels=[p[2] for p in parts],
                           image_ids=torch.tensor([p[3] for p in parts], dtype=torch.int64),
                           scales=torch.tensor([p[4] for p in parts], dtype=torch.float64))
