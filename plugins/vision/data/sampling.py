"""Imbalance: which training image each sampler position shows, and class weights from counts.

The loop's sampler permutes positions ``0..N-1`` each epoch; under ``classify.sampling = "balanced"`` or
``"sqrt"`` position ``k`` of epoch ``e`` shows image ``draws(e)[k]``, where ``draws(e)`` is N draws with
replacement (seeded by ``(train.seed, e)``) with probability per image ``1 / n_c`` (every class equally often)
or ``1 / sqrt(n_c)`` (class frequency ``~ sqrt(n_c)``: square-root sampling, Mahajan et al. 2018). The draws depend
on neither the layout nor the resume point.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from crosstrain.errors import ConfigError

Sampling = Literal["uniform", "balanced", "sqrt"]
ClassWeights = Literal["none", "inverse", "sqrt"]


def class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(labels, minlength=num_classes).astype(np.int64)


def sample_weights(labels: np.ndarray, num_classes: int, sampling: Sampling) -> np.ndarray | None:
    """Each image's draw probability (summing to 1), or None for uniform (the sampler's permutation)."""
    if sampling == "uniform":
        return None
    counts = class_counts(labels, num_classes).astype(np.float64)
    per_class = 1.0 / counts.clip(min=1) if sampling == "balanced" else 1.0 / np.sqrt(counts.clip(min=1))
    w = per_class[labels]
    return w / w.sum()


def draws(weights: np.ndarray, epoch_seed: int) -> np.ndarray:
    """``len(weights)`` image indices drawn with replacement with these probabilities."""
    gen = torch.Generator().manual_seed(epoch_seed)
    return torch.multinomial(torch.from_numpy(weights), len(weights), replacement=True, generator=gen).numpy()


def class_weights(labels: np.ndarray, num_classes: int, kind: ClassWeights) -> torch.Tensor | None:
    """Loss weights per class from the training counts: ``"inverse"`` ``n / (K n_c)`` (scikit-learn's
    ``compute_class_weight("balanced")``), ``"sqrt"`` its square root; None for ``"none"``."""
    if kind == "none":
        return None
    counts = class_counts(labels, num_classes)
    if (counts == 0).any():
        raise ConfigError(f"classify.class_weights={kind!r}: class {int(np.argmin(counts))} has no training image; "
                          "add images of it or set classify.class_weights='none'")
    w = len(labels) / (num_classes * counts.astype(np.float64))
    return torch.tensor(np.sqrt(w) if kind == "sqrt" else w, dtype=torch.float32)
