"""``--recipe classify``: one image classifier trained with cross-entropy or focal loss.

One trainable model ``model`` (:mod:`.models`), batches from :class:`~crosstrain.plugins.vision.data.dataset.
ImageDataset` (``[vision]``), the loss of :mod:`.losses` (label smoothing, class weights from the training counts,
soft labels of mixed samples), optionally an EMA of the weights (:mod:`.ema`). Step metrics: ``loss``, ``top1``
(of the augmented training batch); evaluation: ``eval/loss`` (cross-entropy of the held-out labels),
``eval/top1``, ``eval/top5``, per-class ``eval/precision/<c>`` and ``eval/recall/<c>``, the confusion matrix
(:mod:`.metrics`) and, with EMA, the same under ``eval/ema/``. Data-parallel layouts only (dp_replicate,
dp_shard); ``tokens`` and ``tokens_per_s`` count images.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from crosstrain.config import Config, resolve_import_path
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.errors import ConfigError
from crosstrain.plugins.vision.classify.losses import classification_loss
from crosstrain.plugins.vision.classify.metrics import batch_metrics, class_report
from crosstrain.plugins.vision.data.dataset import ImageDataset, SampleMaker
from crosstrain.plugins.vision.data.mix import Mix
from crosstrain.plugins.vision.data.sources import Source, build_sources

if TYPE_CHECKING:
    from crosstrain.engine.context import RunContext


def layer_scales(model: nn.Module, decay: float) -> dict[str, float]:
    """Each parameter's lr multiplier from timm's ``param_groups_layer_decay`` (BEiT's layer-wise decay: layers by the
    model's ``group_matcher``, else timm's automatic grouping; the head at 1.0); empty when ``decay`` is 0."""
    if not decay:
        return {}
    from crosstrain.plugins.vision.tv import timm

    timm()
    from timm.optim import param_groups_layer_decay

    ids = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups_layer_decay(model, weight_decay=0.0, layer_decay=decay)
    return {ids[id(p)]: float(g["lr_scale"]) for g in groups for p in g["params"]}


class ClassifyRecipe(Recipe):
    """Image classification (module docstring)."""

    name = "classify"
    headline_metrics = ("top1",)

    def __init__(self) -> None:
        self.train_source: Source | None = None
        self.held_out: Source | None = None
        self.ema: Any = None
        self.weight: torch.Tensor | None = None
        self.channels_last = False

    def validate(self, config: Config) -> None:
        from crosstrain.plugins.vision.classify.models import check_name
        from crosstrain.plugins.vision.data.augment import build_transform

        self.vision, self.sec = vision, sec = config.section("vision"), config.section("classify")
        if config.parallel.tp > 1 or config.parallel.pp > 1 or config.parallel.ep > 1:
            raise ConfigError("--recipe classify trains data-parallel only (parallel.dp_replicate, parallel.dp_shard);"
                              " set parallel.tp, parallel.pp and parallel.ep to 1")
        if config.model.import_path:
            resolve_import_path(config.model.import_path)
        else:
            check_name(sec.model)
        build_transform(vision.augment, vision.image_size)  # a wrong table is an error now, not in the first step
        _check_qat(config)
        self.train_source, self.held_out = build_sources(vision)
        if vision.data and not vision.image_size:
            raise ConfigError("vision.data: image files of any size need vision.image_size (e.g. 224) so a batch "
                              "stacks; set it")
        known = len(self.train_source.classes)
        if sec.num_classes and sec.num_classes < known:
            raise ConfigError(f"classify.num_classes={sec.num_classes} is fewer than the data's {known} classes; "
                              f"set it to 0 (the data's) or >= {known}")
        self.num_classes = sec.num_classes or known
        from crosstrain.plugins.vision.data.sampling import class_weights

        self.weight = class_weights(self.train_source.labels, self.num_classes, sec.class_weights)

    @property
    def in_chans(self) -> int:
        assert self.train_source is not None
        return int(self.train_source.load(0).shape[0])

    def build_models(self, context: RunContext) -> dict[str, ModelSpec]:
        cfg = context.config
        if self.train_source is None:
            self.validate(cfg)
        if cfg.model.import_path:
            model = resolve_import_path(cfg.model.import_path)(cfg.model)
            if not isinstance(model, nn.Module):
                raise ConfigError(f"model.import_path {cfg.model.import_path!r} returned {type(model).__name__}, "
                                  "not a torch.nn.Module")
        else:
            from crosstrain.plugins.vision.classify.models import build_classifier

            model = build_classifier(self.sec.model, self.num_classes, self.in_chans, self.sec.pretrained)
        from crosstrain.plugins.vision.layout import model_channels_last, use_channels_last
        from crosstrain.registry import active_backend

        self.channels_last = use_channels_last(self.vision.channels_last, active_backend().device())
        if self.channels_last:  # before the EMA copies it and the loop moves it (.to(device) keeps the format)
            model = model_channels_last(model)
        if self.sec.ema_decay > 0:
            from crosstrain.plugins.vision.classify.ema import Ema

            self.ema = Ema(model, self.sec.ema_decay, self.sec.ema_warmup, context.device)
        return {"model": ModelSpec(model, lr_scale=layer_scales(model, self.sec.layer_decay))}

    def _dataset(self, context: RunContext, source: Source, train: bool) -> ImageDataset:
        from crosstrain.plugins.vision.data.sampling import sample_weights
        from crosstrain.registry import active_backend

        v, seed = self.vision, context.config.train.seed
        mix = Mix(v.mixup_alpha, v.cutmix_alpha, v.mix_prob)
        maker = SampleMaker(source, list(v.augment) if train else None, v.image_size, seed, list(v.mean),
                            list(v.std), self.num_classes, mix)
        weights = sample_weights(source.labels, self.num_classes, self.sec.sampling) if train else None
        return ImageDataset(maker, weights=weights, workers=v.workers if train else 0,
                            pin=active_backend().device().pin_memory)

    def build_dataset(self, context: RunContext) -> ImageDataset:
        if self.train_source is None:
            self.validate(context.config)
        assert self.train_source is not None
        return self._dataset(context, self.train_source, True)

    def build_eval_dataset(self, context: RunContext) -> ImageDataset | None:
        if self.held_out is None:
            self.validate(context.config)
        assert self.held_out is not None
        return self._dataset(context, self.held_out, False) if len(self.held_out) else None

    def batch_tokens(self, batch: Any) -> tuple[torch.Tensor, int]:
        n = int(batch["labels"].numel())  # an image is the unit of throughput
        return torch.tensor(float(n)), n

    def _images(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's images, on the device already, in the model's memory format (``vision.channels_last``)."""
        from crosstrain.plugins.vision.layout import images_channels_last

        return images_channels_last(batch["images"]) if self.channels_last else batch["images"]

    def loss(self, models: Mapping[str, nn.Module], batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        sec = self.sec
        logits = models["model"](self._images(batch))
        loss = classification_loss(logits, batch["labels"], targets=batch.get("targets"), kind=sec.loss,
                                   gamma=sec.focal_gamma, weight=self.weight, label_smoothing=sec.label_smoothing)
        top1 = (logits.detach().argmax(-1) == batch["labels"]).float().mean()
        return MicroBatchLoss(loss, {"top1": top1})

    def _eval(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        logits = model(self._images(batch)).float()
        loss = classification_loss(logits, batch["labels"])
        return loss, batch_metrics(logits, batch["labels"], top_k=self.sec.top_k,
                                   confusion_max=self.sec.confusion_max)

    def eval_loss(self, models: Mapping[str, nn.Module], batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        loss, metrics = self._eval(models["model"], batch)
        if self.ema is not None:
            ema_loss, ema = self._eval(self.ema.module, batch)
            metrics.update({"ema/loss": ema_loss, **{f"ema/{k}": v for k, v in ema.items()
                                                      if not k.startswith("confusion/")}})
        return MicroBatchLoss(loss, metrics)

    def eval_predictions(self, models: Mapping[str, nn.Module], batch: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Each image's ``label``, top-1 ``pred`` (argmax of the logits, as ``eval/top1`` counts it), its class
        name and softmax ``score``."""
        from crosstrain.plugins.vision.predict import top_k

        assert self.train_source is not None
        names = [*self.train_source.classes, *map(str, range(len(self.train_source.classes), self.num_classes))]
        best = top_k(models["model"](self._images(batch)).float().cpu(), names, 1)
        return [{"label": int(y), "pred": b[0]["label"], "class": b[0]["class"], "score": b[0]["score"]}
                for y, b in zip(batch["labels"].tolist(), best, strict=True)]

    def eval_metrics(self, means: Mapping[str, float]) -> dict[str, float]:
        return {**class_report(means, "eval/"), **class_report(means, "eval/ema/")}

    def after_optimizer_step(self, context: RunContext, step: int) -> None:
        if self.ema is not None:
            self.ema.update(context.models["model"], step)

    def state(self) -> dict[str, Any]:
        return {"ema": self.ema} if self.ema is not None else {}

    def data_split(self) -> dict[str, Any]:
        if self.train_source is None:
            return {}
        assert self.held_out is not None
        from crosstrain.plugins.vision.data.sampling import class_counts

        return {"source": self.vision.data or "embedded digits (scikit-learn load_digits)",
                "classes": self.train_source.classes, "train": len(self.train_source), "held_out": len(self.held_out),
                "train_per_class": class_counts(self.train_source.labels, self.num_classes).tolist(),
                "held_out_per_class": class_counts(self.held_out.labels, self.num_classes).tolist()}

    def summary(self) -> dict[str, Any]:
        sec = self.sec
        return {"classify": {"model": sec.model,
                             "num_classes": self.num_classes, "loss": sec.loss, "sampling": sec.sampling,
                             "class_weights": sec.class_weights, "ema_decay": sec.ema_decay,
                             "layer_decay": sec.layer_decay, "channels_last": self.channels_last}}


def _check_qat(config: Config) -> None:
    """A ``[quant] qat`` scheme the conv path does not implement, refused before anything is built."""
    try:
        qat = config.section("quant").qat
    except KeyError:  # the compress plugin is not loaded: no [quant] section
        return
    if qat != "none":
        from crosstrain.plugins.compress.qat.conv import check_conv_scheme

        check_conv_scheme(qat, "--recipe classify's model")
        if config.section("classify").ema_decay > 0:
            raise ConfigError("quant.qat adds fake quantisers to the model after the EMA copies it; set "
                              "classify.ema_decay=0 to train with QAT")
