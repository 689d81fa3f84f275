"""The vision plugin's config sections: ``[vision]`` (images, split, augmentation, loader; shared by the image
recipes) and ``[classify]`` (``--recipe classify``: model, loss, imbalance, EMA)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class VisionSection(BaseModel):
    """Where the images come from and how the training images are augmented (docs/vision.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    data: str = Field(default="", description='"" = the embedded digits (scikit-learn\'s 1,797 8x8 scans, 368 held '
                      "out); or an ImageFolder root: ROOT/train/<class>/* and ROOT/val/<class>/* (or ROOT/<class>/* "
                      "with vision.val_fraction held out)")
    val_fraction: float = Field(default=0.2, gt=0, lt=1, description="an ImageFolder root without val/: the share "
                                "of each class held out (a fixed split, not train.seed's)")
    channels: Literal[0, 1, 3] = Field(default=0, description="decode as 1 (grey) or 3 (RGB) channels; 0 = the "
                                       "data's own (digits: 1, image files: 3)")
    image_size: int = Field(default=0, ge=0, description="resize every image to this square size (0 = keep: digits "
                            "are 8x8; image files must then share one size); a RandomResizedCrop in vision.augment "
                            "sets the training size itself")
    mean: list[float] = Field(default_factory=list, description="per-channel mean subtracted after scaling to [0, 1] "
                              "(empty = 0.5)")
    std: list[float] = Field(default_factory=list, description="per-channel std divided by (empty = 0.5)")
    augment: list[dict[str, Any]] = Field(default_factory=list, description='training augmentation, in order: '
                                          'tables {name = "<torchvision.transforms.v2 class>", <its arguments>}, '
                                          'e.g. {name = "RandomHorizontalFlip"}, {name = "TrivialAugmentWide"}')
    mixup_alpha: float = Field(default=0.0, ge=0, description="MixUp (Zhang et al. 2018) with a partner image drawn "
                               "per sample; Beta(alpha, alpha) mixing weights; 0 = off")
    cutmix_alpha: float = Field(default=0.0, ge=0, description="CutMix (Yun et al. 2019), as mixup_alpha; with both "
                                "on, each sample takes one of the two at random")
    mix_prob: float = Field(default=1.0, ge=0, le=1, description="share of training samples that are mixed")
    workers: int = Field(default=0, ge=0, description="decode and augment in this many worker processes (0 = in the "
                         "training process); the pixels do not depend on it")
    channels_last: Literal["auto", True, False] = Field(default="auto", description="train on NHWC "
                                                        '(torch.channels_last) weights and batches: true, false, '
                                                        'or "auto" = where the backend\'s convolutions prefer it '
                                                        "(Device.prefers_channels_last: cuda, rocm)")


class ClassifySection(BaseModel):
    """Options of ``--recipe classify`` (docs/vision.md)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(default="digits_cnn", description='"digits_cnn" (a 66k-parameter CNN), "timm:<name>" or '
                       '"torchvision:<name>" (any classification model; model.import_path takes precedence)')
    pretrained: bool = Field(default=False, description="load the timm/torchvision model's pretrained weights "
                             "(downloaded by that library)")
    num_classes: int = Field(default=0, ge=0, description="classes of the head (0 = the data's)")
    loss: Literal["ce", "focal"] = Field(default="ce", description='"ce": cross-entropy; "focal": softmax focal '
                                         "loss (Lin et al. 2017)")
    focal_gamma: float = Field(default=2.0, ge=0, description="focal loss: the focusing exponent gamma")
    label_smoothing: float = Field(default=0.0, ge=0, lt=1, description="mix eps of the uniform distribution into "
                                   "the labels")
    class_weights: Literal["none", "inverse", "sqrt"] = Field(default="none", description='loss weight per class '
                                                              'from the training counts: "inverse" n/(K n_c), '
                                                              '"sqrt" its square root')
    sampling: Literal["uniform", "balanced", "sqrt"] = Field(default="uniform", description='"balanced": every '
                                                             'class equally often; "sqrt": class frequency ~ '
                                                             "sqrt(count); drawn with replacement per epoch")
    ema_decay: float = Field(default=0.0, ge=0, lt=1, description="keep an exponential moving average of the "
                             "weights (timm's ModelEmaV3) with this decay, evaluated as eval/ema/*; 0 = off")
    ema_warmup: bool = Field(default=False, description="EMA: timm's warmup of the decay (1 - (1 + step)^-2/3)")
    layer_decay: float = Field(default=0.0, ge=0, le=1, description="layer-wise lr decay for fine-tuning (timm's "
                               "param_groups_layer_decay): layer i of L trains at lr x decay^(L-1-i); 0 = off")
    top_k: int = Field(default=5, ge=2, description="the second accuracy reported: top-k (when there are more "
                       "than k classes)")
    confusion_max: int = Field(default=20, ge=0, description="report the confusion matrix (eval/confusion/<true>/"
                               "<pred>, shares of the held-out images) up to this many classes")
