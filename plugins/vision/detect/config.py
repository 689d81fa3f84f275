"""``[detect]``: the options of ``--recipe detect`` (docs/vision_detect.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DetectSection(BaseModel):
    """Model, data, augmentation and evaluation of ``--recipe detect``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: Literal["fcos_resnet18_fpn", "retinanet_resnet18_fpn"] = Field(
        default="fcos_resnet18_fpn", description="torchvision detector with a ResNet-18 + FPN backbone "
        "(GroupNorm, trained from scratch)")
    fpn_channels: int = Field(default=64, ge=32, multiple_of=32, description="channels of the FPN and the heads")
    train_annotations: str = Field(default="", description='COCO instances JSON of the training images ("" = the '
                                   "embedded synthetic shapes)")
    train_images: str = Field(default="", description="folder of the training images (file_name in the JSON)")
    val_annotations: str = Field(default="", description="COCO instances JSON of the held-out images")
    val_images: str = Field(default="", description="folder of the held-out images")
    shapes_train: int = Field(default=1024, ge=1, description="embedded shapes: training images")
    shapes_val: int = Field(default=128, ge=1, description="embedded shapes: held-out images")
    shapes_size: int = Field(default=64, ge=32, description="embedded shapes: image side in pixels")
    shapes_seed: int = Field(default=0, ge=0, description="embedded shapes: the seed their pixels and boxes come from")
    shapes_dir: str = Field(default="", description='where the embedded shapes are written ("" = '
                            "$XDG_CACHE_HOME/crosstrain/vision)")
    min_size: int = Field(default=48, ge=16, description="multi-scale training: smallest longer image side (pixels)")
    max_size: int = Field(default=80, ge=16, description="multi-scale training: largest longer image side (pixels)")
    size_step: int = Field(default=8, ge=1, description="multi-scale training: sizes are min_size + k * size_step")
    eval_size: int = Field(default=64, ge=16, description="the longer image side at evaluation (pixels)")
    augment: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"name": "RandomHorizontalFlip", "p": 0.5}],
        description="torchvision.transforms.v2 transforms applied in order to each training image and its boxes, "
        'as vision.augment: [{name = "RandomHorizontalFlip", p = 0.5}, {name = "RandomPhotometricDistort"}] '
        "(seeded per sample)")
    score_thresh: float = Field(default=0.05, ge=0, lt=1, description="detections below this score are dropped")
    detections_per_img: int = Field(default=100, ge=1, description="detections kept per image (COCO's maxDets)")

    @model_validator(mode="after")
    def check_sizes(self) -> DetectSection:
        if self.min_size > self.max_size:
            raise ValueError(f"detect.min_size={self.min_size} exceeds detect.max_size={self.max_size}; set "
                             "min_size <= max_size")
        if bool(self.train_annotations) != bool(self.train_images) or (
                bool(self.val_annotations) != bool(self.val_images)):
            raise ValueError("set detect.train_annotations with detect.train_images (and val_annotations with "
                             "val_images): each JSON needs its image folder")
        if self.val_annotations and not self.train_annotations:
            raise ValueError("detect.val_annotations without detect.train_annotations; set both (or neither, for "
                             "the embedded shapes)")
        return self

    def train_sizes(self) -> list[int]:
        """The longer image sides multi-scale training draws from."""
        return list(range(self.min_size, self.max_size + 1, self.size_step))
