"""Predictions of a loaded image model on decoded images: top-k classes with softmax scores (``classify``) and
boxes in the sent image's pixels (``detect``). Shared by ``crosstrain serve`` and ``crosstrain eval --predictions``."""

from __future__ import annotations

from typing import Any

import torch

from crosstrain.plugins.vision.load import ImageModel


def top_k(logits: torch.Tensor, classes: list[str], k: int) -> list[list[dict[str, Any]]]:
    """Per row: the ``k`` most probable classes, most probable first (ties: the lower label, as ``argmax``), each
    ``{"label", "class", "score"}`` with ``score`` its softmax probability."""
    probs = torch.softmax(logits.float(), dim=-1)
    k = min(k, probs.shape[-1])
    # a stable descending sort keeps the lower label first among equal scores: the top-1 is argmax's
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    return [[{"label": int(j), "class": classes[int(j)], "score": float(row[j])} for j in idx]
            for row, idx in zip(probs, order, strict=True)]


@torch.no_grad()
def classify(model: ImageModel, images: list[torch.Tensor], k: int) -> list[list[dict[str, Any]]]:
    """uint8 ``[C, H, W]`` images -> their top-k classes (:func:`top_k`) from the classifier's logits."""
    return top_k(model.model(model.preprocess(images)), model.classes, k)


@torch.no_grad()
def detect(model: ImageModel, images: list[torch.Tensor]) -> list[list[dict[str, Any]]]:
    """uint8 ``[3, H, W]`` images -> their detections, each ``{"box": [x0, y0, x1, y1], "label", "class",
    "score"}`` in the image's own pixels: resized so the longer side is ``detect.eval_size``, as the held-out images
    were evaluated (:class:`~crosstrain.plugins.vision.detect.data.DetectDataset`), and the boxes scaled back."""
    from torchvision.transforms import v2

    size = model.shape[1]
    fed, scales = [], []
    for img in images:
        h, w = img.shape[-2:]
        scale = size / max(h, w)
        x = v2.functional.to_dtype(img, torch.float32, scale=True)
        fed.append(v2.functional.resize(x, [round(h * scale), round(w * scale)]))
        scales.append(1.0 / scale)
    out = []
    for det, scale in zip(model.model(fed), scales, strict=True):
        boxes = det["boxes"].double() * scale
        out.append([{"box": [round(v, 3) for v in box], "label": int(label), "class": model.classes[int(label)],
                     "score": float(score)}
                    for box, label, score in zip(boxes.tolist(), det["labels"].tolist(), det["scores"].tolist(),
                                                 strict=True)])
    return out
