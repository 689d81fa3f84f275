"""torchvision detectors by name, with a small backbone that trains from scratch on a CPU.

The backbone is torchvision's ResNet-18 (``weights=None``) with GroupNorm in place of BatchNorm (from scratch,
with small per-rank batches, batch statistics would differ between layouts; FCOS's head uses GroupNorm too) and
an FPN over C3-C5 with P6/P7 (Lin et al. 2017; Tian et al. 2019). The model's own ``transform`` only normalises
and pads: the data pipeline sizes the images (multi-scale per batch), so the model never resizes them again.

FCOS divides its summed losses by the batch's number of foreground locations; on data-parallel ranks that count is
the global batch's (:class:`GlobalCountFCOSHead`, as detectron2's and mmdet's ``reduce_mean(num_pos)``), so
``dp_shard=2`` trains what one process trains. RetinaNet normalises per image, which needs nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from crosstrain.plugins.vision.tv import torchvision as _torchvision

_torchvision()  # nms usable before torchvision's detection code runs (crosstrain.torchvision_compat)

from torchvision.models.detection.fcos import FCOSHead  # noqa: E402


class GlobalCountFCOSHead(FCOSHead):
    """torchvision's FCOS head with its losses normalised by the foreground count of the whole data-parallel batch.

    torchvision divides each summed loss by this process's ``num_foreground`` (its references train so); with the
    global count ``N`` over ``W`` ranks each rank returns ``S_r * W / N``, whose average over ranks (the loop's loss,
    DDP/FSDP's gradient) is the one-process ``sum_r S_r / N``. On one process the factor is exactly 1.
    """

    def compute_loss(self, targets: list[dict[str, torch.Tensor]], head_outputs: dict[str, torch.Tensor],
                     anchors: list[torch.Tensor], matched_idxs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        from crosstrain.collective import global_sums

        losses = super().compute_loss(targets, head_outputs, anchors, matched_idxs)
        local = torch.stack([(m >= 0).sum() for m in matched_idxs]).sum().float()
        ranks = torch.ones((), device=local.device)
        total, world = global_sums(torch.stack([local, ranks])).tolist()
        if world == 1:
            return losses
        factor = max(1.0, local.item()) * world / max(1.0, total)
        return {name: value * factor for name, value in losses.items()}


def _keep_size_transform(transform: Any) -> Any:
    """torchvision's GeneralizedRCNNTransform with ``resize`` made the identity (normalise and pad only)."""
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    class KeepSize(GeneralizedRCNNTransform):
        def resize(self, image: torch.Tensor, target: Any = None) -> tuple[torch.Tensor, Any]:
            return image, target

    return KeepSize(transform.min_size, transform.max_size, transform.image_mean, transform.image_std,
                    size_divisible=transform.size_divisible, fixed_size=transform.fixed_size)


def backbone_fpn(channels: int) -> nn.Module:
    """ResNet-18 (GroupNorm, random init) + FPN on C3-C5 with P6/P7: five levels of ``channels``."""
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    body = resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(32, c))
    return BackboneWithFPN(body, return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
                           in_channels_list=[128, 256, 512], out_channels=channels,
                           extra_blocks=LastLevelP6P7(channels, channels))


def build_detector(name: str, num_classes: int, *, channels: int = 64, score_thresh: float = 0.05,
                   detections_per_img: int = 100) -> nn.Module:
    """The detector ``name`` (``fcos_resnet18_fpn`` or ``retinanet_resnet18_fpn``) for labels ``0..num_classes-1``
    (COCO category ids as they are; 0 unused), initialised from the global torch RNG."""
    from torchvision.models.detection import FCOS, RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    backbone = backbone_fpn(channels)
    common = {"num_classes": num_classes, "min_size": 64, "max_size": 64, "score_thresh": score_thresh,
              "detections_per_img": detections_per_img}
    model: nn.Module
    if name == "fcos_resnet18_fpn":  # torchvision's fcos_resnet50_fpn: one point per location, sizes = strides
        anchors = AnchorGenerator(((8,), (16,), (32,), (64,), (128,)), ((1.0,),) * 5)
        head = GlobalCountFCOSHead(backbone.out_channels, anchors.num_anchors_per_location()[0], num_classes)
        model = FCOS(backbone, anchor_generator=anchors, head=head, **common)
    elif name == "retinanet_resnet18_fpn":  # torchvision's retinanet_resnet50_fpn, anchors a quarter its size
        sizes = tuple((x, int(x * 2 ** (1 / 3)), int(x * 2 ** (2 / 3))) for x in (8, 16, 32, 64, 128))
        anchors = AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * 5)
        model = RetinaNet(backbone, anchor_generator=anchors, **common)
    else:
        raise ValueError(f"unknown detector {name!r}")
    model.transform = _keep_size_transform(model.transform)
    return model
