"""Classification losses over hard or soft labels: cross-entropy with label smoothing, and softmax focal loss.

Both average over the samples of the batch (``sum_i l_i / B``), also with class weights (torch's weighted
``cross_entropy`` divides by ``sum_i w_{y_i}`` instead): so the loss of a batch split over data-parallel ranks or
micro-batches is the mean of its parts, and every layout trains what one process trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_targets(labels: torch.Tensor, num_classes: int, targets: torch.Tensor | None = None,
                 label_smoothing: float = 0.0) -> torch.Tensor:
    """``[B, K]`` label distributions: one-hot ``labels`` (or the soft ``targets`` of mixed samples), smoothed as
    ``(1 - eps) y + eps / K`` (Szegedy et al. 2016; what ``F.cross_entropy(label_smoothing=eps)`` uses)."""
    y = targets.float() if targets is not None else F.one_hot(labels, num_classes).float()
    return y * (1.0 - label_smoothing) + label_smoothing / num_classes if label_smoothing else y


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample softmax focal loss (Lin et al. 2017, "Focal Loss for Dense Object Detection", eq. 5 for K
    classes): ``FL = -sum_c w_c y_c (1 - p_c)^gamma log p_c`` with ``p = softmax(logits)`` and label
    distribution ``y`` ``[B, K]``; ``gamma = 0`` is (weighted) cross-entropy."""
    logp = F.log_softmax(logits.float(), dim=-1)
    modulating = (1.0 - logp.exp()).clamp_min(0.0).pow(gamma) if gamma else torch.ones_like(logp)
    per_class = -targets * modulating * logp
    if weight is not None:
        per_class = per_class * weight.to(per_class.device)
    return per_class.sum(-1)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, *, targets: torch.Tensor | None = None,
                        kind: str = "ce", gamma: float = 2.0, weight: torch.Tensor | None = None,
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """The mean over the batch of cross-entropy (``kind="ce"``) or focal loss, with label smoothing and weights."""
    if kind == "ce" and targets is None and weight is None and not label_smoothing:
        # plain hard-label cross-entropy: torch's fused kernel, the same gradients bit for bit as the general path
        # below (tests/test_vision_parts.py) at half its cost, which matters on a 5 ms step
        return F.cross_entropy(logits.float(), labels)
    y = soft_targets(labels, logits.shape[-1], targets, label_smoothing)
    return focal_loss(logits, y, gamma if kind == "focal" else 0.0, weight).mean()
