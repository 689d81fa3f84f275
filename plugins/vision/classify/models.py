"""Classification models by name: the small default CNN, any timm or torchvision classifier, or ``model.import_path``.

``classify.model``: ``"digits_cnn"`` (the default, :class:`DigitsCNN`), ``"timm:<name>"`` (``timm.create_model``
with ``num_classes`` and ``in_chans``), ``"torchvision:<name>"`` (``torchvision.models.get_model`` with
``num_classes``; 3 input channels). ``model.import_path`` takes precedence, as in every recipe.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.errors import ConfigError


class DigitsCNN(nn.Module):
    """Four 3x3 convolutions (32, 32, 64, 64 channels) with GroupNorm and ReLU, a 2x2 max-pool after the second,
    global average pooling and a linear head: 66k parameters. GroupNorm, not BatchNorm, so a batch split over
    ranks or micro-batches computes what one process computes."""

    def __init__(self, in_chans: int = 1, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True)]

        w = width
        self.features = nn.Sequential(*block(in_chans, w), *block(w, w), nn.MaxPool2d(2),
                                      *block(w, 2 * w), *block(2 * w, 2 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * w, num_classes)

    def forward(self, x: Any) -> Any:
        return self.head(self.features(x))


def check_name(name: str) -> None:
    """A one-line ConfigError when ``classify.model`` names no model here (before any run dir exists)."""
    kind, _, model = name.partition(":")
    if name == "digits_cnn":
        return
    if kind == "timm" and model:
        from crosstrain.plugins.vision.tv import timm

        if not timm().is_model(model):
            near = timm().list_models(f"*{model}*")[:5]
            raise ConfigError(f"classify.model={name!r}: timm has no model {model!r}"
                              + (f" (close: {', '.join(near)})" if near else "") + "; `timm.list_models()` lists them")
        return
    if kind == "torchvision" and model:
        from crosstrain.plugins.vision.tv import torchvision

        names = torchvision().models.list_models(module=torchvision().models)
        if model not in names:
            raise ConfigError(f"classify.model={name!r}: torchvision has no classification model {model!r}; "
                              "torchvision.models.list_models(module=torchvision.models) lists them")
        return
    raise ConfigError(f"classify.model={name!r} is not a model name; give \"digits_cnn\", \"timm:<name>\" (e.g. "
                      "timm:resnet18) or \"torchvision:<name>\", or set model.import_path")


def build_classifier(name: str, num_classes: int, in_chans: int, pretrained: bool = False) -> nn.Module:
    kind, _, model = name.partition(":")
    if name == "digits_cnn":
        return DigitsCNN(in_chans, num_classes)
    if kind == "timm":
        from crosstrain.plugins.vision.tv import timm

        return timm().create_model(model, pretrained=pretrained, num_classes=num_classes, in_chans=in_chans)
    from crosstrain.plugins.vision.tv import torchvision

    if in_chans != 3:
        raise ConfigError(f"classify.model={name!r} takes 3-channel images, the data has {in_chans}; set "
                          "vision.channels=3 (or use a timm model, which adapts in_chans)")
    weights = "DEFAULT" if pretrained else None
    return torchvision().models.get_model(model, weights=weights, num_classes=num_classes)
