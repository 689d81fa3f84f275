"""The plain training loop ``--recipe detect`` is checked against, in the style of torchvision's
references/detection/train.py (``train_one_epoch``: ``loss_dict = model(images, targets)``, ``losses =
sum(loss_dict.values())``, ``zero_grad``, ``backward``, ``clip_grad_norm_``, ``optimizer.step()``,
``lr_scheduler.step()`` per iteration).

It shares with the recipe only what defines "the same model and data": the detector builder, the dataset and
its per-sample / per-step seeds. The init seed, the data order (the loop sampler's seeded permutation per epoch,
ragged tail dropped), the optimizer (AdamW or SGD, decay on matrices only), the warmup + cosine schedule and the
clipping are written out here with plain torch, so a difference in crosstrain's loop shows as a difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from crosstrain.plugins.vision.detect.data import DetectDataset
from crosstrain.plugins.vision.detect.models import build_detector


@dataclass
class ReferenceConfig:
    """What the plain loop needs; :func:`from_config` reads it from a crosstrain config."""

    model: str
    num_classes: int
    channels: int
    score_thresh: float
    detections_per_img: int
    steps: int
    batch_size: int
    seed: int
    optimizer: str
    lr: float
    betas: tuple[float, float]
    eps: float
    momentum: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    grad_clip: float
    losses: list[float] = field(default_factory=list)


def from_config(config: Any, num_classes: int) -> ReferenceConfig:
    sec, o, s = config.section("detect"), config.optim, config.schedule
    if s.name != "cosine":
        raise ValueError(f"the reference loop implements schedule.name='cosine', not {s.name!r}")
    return ReferenceConfig(model=sec.model, num_classes=num_classes, channels=sec.fpn_channels,
                           score_thresh=sec.score_thresh, detections_per_img=sec.detections_per_img,
                           steps=config.train.steps, batch_size=config.train.batch_size, seed=config.train.seed,
                           optimizer=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.momentum,
                           weight_decay=o.weight_decay, warmup_steps=s.warmup_steps,
                           total_steps=s.total_steps or config.train.steps, min_lr_ratio=s.min_lr_ratio,
                           grad_clip=o.grad_clip)


def warmup_cosine(cfg: ReferenceConfig) -> Callable[[int], float]:
    """Linear warmup to the peak over ``warmup_steps``, then half a cosine down to ``min_lr_ratio`` of it."""
    def factor(i: int) -> float:
        if i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        progress = min(max(i - cfg.warmup_steps, 0) / max(cfg.total_steps - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(cfg: ReferenceConfig, dataset: DetectDataset) -> torch.nn.Module:
    """Train a fresh detector for ``cfg.steps`` steps on ``dataset``; the loss of each step goes to
    ``cfg.losses``. Returns the model (train mode)."""
    torch.manual_seed(cfg.seed)
    model = build_detector(cfg.model, cfg.num_classes, channels=cfg.channels, score_thresh=cfg.score_thresh,
                           detections_per_img=cfg.detections_per_img)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer: torch.optim.Optimizer
    if cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    else:
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))
    step, epoch, n = 0, 0, len(dataset)
    dataset.step = lambda: step
    while step < cfg.steps:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)).numpy()
        for start in range(0, n - cfg.batch_size + 1, cfg.batch_size):
            if step == cfg.steps:
                break
            step += 1
            batch = dataset.batch(order[start:start + cfg.batch_size])
            loss_dict = model(batch.images, batch.targets())
            losses = sum(loss for loss in loss_dict.values())
            optimizer.zero_grad()
            losses.backward()  # type: ignore[union-attr]
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            lr_scheduler.step()
            cfg.losses.append(float(losses.detach()))  # type: ignore[union-attr]
        epoch += 1
    return model


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: DetectDataset, batch_size: int) -> dict[str, float]:
    """COCO ``map`` / ``map_50`` of ``model`` on the held-out ``dataset``, full batches in order (as torchvision's
    references/detection/engine.py ``evaluate``: eval mode, detections to COCO results, pycocotools)."""
    from crosstrain.plugins.vision.detect.metrics import coco_map, to_coco_results

    model.eval()
    rows: list[dict[str, Any]] = []
    ids: list[int] = []
    for start in range(0, len(dataset) - batch_size + 1, batch_size):
        batch = dataset.batch(list(range(start, start + batch_size)))
        rows += to_coco_results(batch.image_ids, batch.scales, model(batch.images))
        ids += batch.image_ids.tolist()
    return coco_map(dataset.samples.coco, rows, ids)
