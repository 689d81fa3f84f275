"""``--recipe detect``: a torchvision detector (FCOS or RetinaNet, ResNet-18 + FPN from scratch) on COCO-format data.

The loss of a micro-batch is the detector's own: in train mode a torchvision detector returns its loss dict
(FCOS: ``classification``, ``bbox_regression``, ``bbox_ctrness``; RetinaNet: ``classification``,
``bbox_regression``), summed as torchvision's references/detection/train.py sums it, each reported as
``loss/<name>``. Training is multi-scale: each step's images are resized so their longer side is a size drawn per
step from ``detect.min_size..max_size``. Evaluation reports the held-out loss and COCO ``map`` (AP@[.5:.95]) and
``map_50`` (AP@.5) through pycocotools over the whole held-out split (:meth:`eval_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from crosstrain.config import Config
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError

if TYPE_CHECKING:
    from crosstrain.plugins.vision.detect.data import DetectBatch, DetectDataset

MODEL = "detector"


def detector_loss(model: nn.Module, batch: DetectBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed loss of a torchvision detector in train mode and its parts (torchvision's references sum them
    the same way)."""
    parts = model(batch.images, batch.targets())
    return sum(parts.values()), {f"loss/{k}": v.detach() for k, v in parts.items()}  # type: ignore[return-value]


class DetectRecipe(Recipe):
    """Object detection (module docstring); one trainable model, ``detector``."""

    name = "detect"

    def __init__(self) -> None:
        self.train_samples: Any = None
        self.val_samples: Any = None
        self.sources: dict[str, Any] = {}
        self._rows: list[dict[str, Any]] = []
        self._image_ids: list[int] = []
        self.last_eval: dict[str, float] = {}

    def validate(self, config: Config) -> None:
        self.sec = sec = config.section("detect")
        if config.parallel.tp > 1 or config.parallel.pp > 1:
            raise ConfigError("--recipe detect shards data only; set parallel.tp=1 and parallel.pp=1 (use "
                              "parallel.dp_shard or dp_replicate)")
        try:
            qat = config.section("quant").qat
        except KeyError:  # the compress plugin is not loaded: no [quant] section
            qat = "none"
        if qat != "none":
            raise ConfigError(f"quant.qat={qat!r} is not built for --recipe detect (its conv QAT and integer export "
                              "are the classifier's); set quant.qat=\"none\"")
        try:
            import pycocotools  # noqa: F401

            from crosstrain.plugins.vision.tv import torchvision

            torchvision()
        except ImportError as e:
            raise ConfigError(f"--recipe detect needs torchvision and pycocotools ({e.name} is missing); "
                              'pip install "crosstrain[vision]"') from None
        from crosstrain.plugins.vision.data.augment import build_transform

        self.augment = build_transform(sec.augment, key="detect.augment")
        for key in ("train_annotations", "train_images", "val_annotations", "val_images"):
            path = getattr(sec, key)
            if path and not Path(path).exists():
                raise ConfigError(f"detect.{key}={path} does not exist; point it at a COCO instances JSON / image "
                                  "folder (or unset the detect.*_annotations keys for the embedded shapes)")
        if sec.train_annotations and not sec.val_annotations:
            raise ConfigError("detect.train_annotations needs held-out images too; set detect.val_annotations and "
                              "detect.val_images")

    def _load(self, config: Config) -> None:
        """Read both COCO JSONs (writing the embedded shapes first when no data is named)."""
        if self.train_samples is not None:
            return
        from crosstrain.plugins.vision.detect.data import CocoSamples

        sec = config.section("detect")
        if sec.train_annotations:
            train = (sec.train_images, sec.train_annotations)
            val = (sec.val_images, sec.val_annotations)
            self.sources = {"source": "coco"}
        else:
            from crosstrain.engine.fast_defaults import cache_root
            from crosstrain.plugins.vision.detect.shapes import ensure_shapes

            root = ensure_shapes(Path(sec.shapes_dir) if sec.shapes_dir else cache_root() / "vision",
                                 train=sec.shapes_train, val=sec.shapes_val, size=sec.shapes_size,
                                 seed=sec.shapes_seed)
            train, val = (root / "train", root / "train.json"), (root / "val", root / "val.json")
            self.sources = {"source": "embedded shapes", "folder": str(root)}
        self.train_samples, self.val_samples = CocoSamples(*train), CocoSamples(*val)
        if not len(self.train_samples) or not len(self.val_samples):
            raise ConfigError("the detection data has no images in one split; check detect.*_annotations")

    def num_classes(self) -> int:
        """Logits per location: COCO category ids are used as labels as they are (torchvision's convention)."""
        return max(self.train_samples.categories + self.val_samples.categories) + 1

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        from crosstrain.plugins.vision.detect.models import build_detector

        self._load(context.config)
        sec = self.sec
        model = build_detector(sec.model, self.num_classes(), channels=sec.fpn_channels,
                               score_thresh=sec.score_thresh, detections_per_img=sec.detections_per_img)
        return {MODEL: ModelSpec(model)}

    def build_dataset(self, context: Any) -> DetectDataset:
        from crosstrain.plugins.vision.detect.data import DetectDataset

        self._load(context.config)
        return DetectDataset(self.train_samples, sizes=self.sec.train_sizes(), seed=context.config.train.seed,
                             augment=self.augment, step=lambda: context.step + 1)

    def build_eval_dataset(self, context: Any) -> DetectDataset:
        from crosstrain.plugins.vision.detect.data import DetectDataset

        self._load(context.config)
        return DetectDataset(self.val_samples, sizes=[self.sec.eval_size], seed=context.config.train.seed)

    def loss(self, models: Mapping[str, nn.Module], batch: DetectBatch) -> MicroBatchLoss:
        loss, parts = detector_loss(models[MODEL], batch)
        return MicroBatchLoss(loss, parts)

    def eval_loss(self, models: Mapping[str, nn.Module], batch: DetectBatch) -> MicroBatchLoss:
        """The held-out loss (a train-mode forward: torchvision detectors return losses only there; GroupNorm
        and no dropout make it free of side effects) and the detections (eval mode), kept for :meth:`eval_metrics`."""
        from crosstrain.plugins.vision.detect.metrics import to_coco_results

        model = models[MODEL]
        model.train()
        try:
            loss, parts = detector_loss(model, batch)
        finally:
            model.eval()
        self._rows += to_coco_results(batch.image_ids, batch.scales, model(batch.images))
        self._image_ids += batch.image_ids.tolist()
        return MicroBatchLoss(loss, parts)

    def eval_metrics(self, means: Mapping[str, float]) -> dict[str, float]:
        """COCO ``eval/map`` and ``eval/map_50`` of the detections of this evaluation, gathered from every rank."""
        import torch.distributed as dist

        from crosstrain.plugins.vision.detect.metrics import coco_map

        rows, ids = self._rows, self._image_ids
        self._rows, self._image_ids = [], []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (rows, ids))
            rows = [r for part, _ in gathered for r in part]
            ids = [i for _, part in gathered for i in part]
        self.last_eval = coco_map(self.val_samples.coco, rows, ids)
        return {f"eval/{name}": float(value) for name, value in self.last_eval.items()}

    def batch_tokens(self, batch: DetectBatch) -> tuple[torch.Tensor, int]:
        """Images count as the "tokens" of tokens/s (so it reads images/s)."""
        return torch.tensor(float(len(batch.images))), len(batch.images)

    def data_split(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.sources)
        for split, samples in (("train", self.train_samples), ("val", self.val_samples)):
            if samples is not None:
                out[split] = {"images": len(samples), "annotations": str(samples.annotations)}
        return out

    def summary(self) -> dict[str, Any]:
        sec = self.sec
        return {"detect": {"model": sec.model, "fpn_channels": sec.fpn_channels, "num_classes": self.num_classes(),
                           "train_sizes": sec.train_sizes(), "eval_size": sec.eval_size, "augment": sec.augment,
                           **self.sources, "eval": self.last_eval}}
