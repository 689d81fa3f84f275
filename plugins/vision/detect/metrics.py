"""COCO detection metrics through pycocotools (the reference implementation, not a re-derivation).

``map`` is COCO's AP averaged over IoU 0.50:0.05:0.95 and ``map_50`` its AP at IoU 0.50 (all areas, 100
detections per image; Lin et al. 2014, cocodataset.org/#detection-eval); the names are torchmetrics'
``MeanAveragePrecision`` keys.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def to_coco_results(image_ids: torch.Tensor, scales: torch.Tensor,
                    detections: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """torchvision detections (xyxy boxes in the fed image's pixels) as COCO result rows (xywh boxes in the
    annotation's pixels: times ``scales``)."""
    rows = []
    for image_id, scale, det in zip(image_ids.tolist(), scales.tolist(), detections, strict=True):
        boxes = det["boxes"].detach().double().cpu() * scale
        for (x0, y0, x1, y1), score, label in zip(boxes.tolist(), det["scores"].tolist(), det["labels"].tolist(),
                                                  strict=True):
            rows.append({"image_id": int(image_id), "category_id": int(label), "score": float(score),
                         "bbox": [x0, y0, x1 - x0, y1 - y0]})
    return rows


def coco_map(coco_gt: Any, results: list[dict[str, Any]], image_ids: Iterable[int]) -> dict[str, float]:
    """``{"map", "map_50"}`` of ``results`` on the images ``image_ids`` of ``coco_gt`` (a pycocotools COCO)."""
    from pycocotools.cocoeval import COCOeval

    ids = sorted(set(int(i) for i in image_ids))
    if not results:  # loadRes refuses an empty list; no detection scores 0
        return {"map": 0.0, "map_50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and table
        coco_dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.imgIds = ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map": max(float(ev.stats[0]), 0.0), "map_50": max(float(ev.stats[1]), 0.0)}
