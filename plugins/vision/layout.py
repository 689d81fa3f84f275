"""``vision.channels_last``: whether the image recipes train on NHWC (``torch.channels_last``) tensors.

PyTorch's "Channels Last Memory Format" tutorial: a model converted with ``model.to(memory_format=
torch.channels_last)`` and fed channels_last inputs runs its convolutions in NHWC, which the vendors' kernels prefer
on tensor-core GPUs. The values are the same; only the strides (and so the convolution algorithm) change.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from crosstrain.device import Device

Setting = Literal["auto", True, False]


def use_channels_last(setting: Setting, device: Device) -> bool:
    """``true``/``false`` as given; ``"auto"``: the device's :attr:`~crosstrain.device.Device.prefers_channels_last`."""
    return device.prefers_channels_last if setting == "auto" else bool(setting)


def model_channels_last(model: nn.Module) -> nn.Module:
    """The model with its 4-D parameters and buffers (conv weights) in channels_last, in place."""
    return model.to(memory_format=torch.channels_last)


def images_channels_last(images: torch.Tensor) -> torch.Tensor:
    """A 4-D ``[B, C, H, W]`` batch in channels_last (a copy only when it is not already); other ranks unchanged."""
    return images.contiguous(memory_format=torch.channels_last) if images.dim() == 4 else images
