"""MixUp (Zhang et al. 2018) and CutMix (Yun et al. 2019) per sample, through torchvision.transforms.v2.

torchvision's ``v2.MixUp`` / ``v2.CutMix`` mix each image of a batch with its neighbour in the batch, so the result
would depend on how a step's batch is split over ranks and micro-batches. Here each sample draws its own partner
from the whole training set (seeded per sample) and the pair ``[sample, partner]`` goes through the v2 transform,
of which the first image is kept: the same mixing distribution, independent of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mix:
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0

    @property
    def on(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def plan(self, seed: int, num_images: int) -> tuple[str, int] | None:
        """``(method, partner index)`` for the sample with this seed, or None when it is not mixed."""
        gen = torch.Generator().manual_seed(seed)
        mixed, pick = torch.rand(2, generator=gen).tolist()
        partner = int(torch.randint(num_images, (1,), generator=gen))
        if not self.on or mixed >= self.prob:
            return None
        methods = [m for m, a in (("mixup", self.mixup_alpha), ("cutmix", self.cutmix_alpha)) if a > 0]
        return methods[min(int(pick * len(methods)), len(methods) - 1)], partner

    def apply(self, method: str, pair: torch.Tensor, labels: torch.Tensor, num_classes: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first image of ``pair [2, C, H, W]`` mixed with the second, and its soft label ``[num_classes]``."""
        from crosstrain.plugins.vision.data.augment import rng_restored, seeded
        from crosstrain.plugins.vision.tv import v2 as transforms

        v2 = transforms()
        transform = (v2.MixUp(alpha=self.mixup_alpha, num_classes=num_classes) if method == "mixup"
                     else v2.CutMix(alpha=self.cutmix_alpha, num_classes=num_classes))
        with rng_restored():  # also outside a batch (the plan's own generator is separate)
            images, soft = seeded(lambda x: transform(*x), (pair, labels), seed)
        return images[0], soft[0]
