"""Classification metrics that survive the loop's averaging over batches and ranks.

Evaluation averages each metric over data-parallel ranks and equal-sized batches, so a metric that is a share
of a batch's images averages to the share of all held-out images. Per batch, :func:`batch_metrics` gives top-1
and top-5 accuracy, and per class ``c`` the shares ``tp/c`` (label c, predicted c), ``true/c`` (label c) and
``pred/c`` (predicted c), and for at most ``confusion_max`` classes ``confusion/<t>/<p>``; :func:`class_report`
turns the averaged shares into per-class precision and recall (ratios of shares are ratios of counts).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def batch_metrics(logits: torch.Tensor, labels: torch.Tensor, *, top_k: int = 5,
                  confusion_max: int = 20) -> dict[str, torch.Tensor]:
    k = logits.shape[-1]
    pred = logits.argmax(-1)
    out = {"top1": (pred == labels).float().mean()}
    if k > top_k:
        hit = (logits.topk(top_k, dim=-1).indices == labels[:, None]).any(-1)
        out[f"top{top_k}"] = hit.float().mean()
    n = float(labels.numel())
    confusion = torch.zeros(k, k, device=logits.device)
    confusion.index_put_((labels, pred), torch.ones_like(labels, dtype=torch.float32), accumulate=True)
    confusion /= n
    diag, true, predicted = confusion.diagonal(), confusion.sum(1), confusion.sum(0)
    for c in range(k):
        out[f"tp/{c}"], out[f"true/{c}"], out[f"pred/{c}"] = diag[c], true[c], predicted[c]
    if k <= confusion_max:
        for t in range(k):
            for p in range(k):
                out[f"confusion/{t}/{p}"] = confusion[t, p]
    return out


def class_report(metrics: Mapping[str, float], prefix: str = "eval/") -> dict[str, float]:
    """``precision/c``, ``recall/c`` (0 where a class was never predicted / has no image) and their macro means
    from averaged ``tp/c``, ``true/c``, ``pred/c`` shares under ``prefix``."""
    classes = sorted(int(key[len(prefix) + 3:]) for key in metrics if key.startswith(f"{prefix}tp/"))
    out: dict[str, float] = {}
    for c in classes:
        tp, true, pred = (float(metrics[f"{prefix}{name}/{c}"]) for name in ("tp", "true", "pred"))
        out[f"{prefix}precision/{c}"] = tp / pred if pred > 0 else 0.0
        out[f"{prefix}recall/{c}"] = tp / true if true > 0 else 0.0
    if classes:
        out[f"{prefix}macro_precision"] = sum(out[f"{prefix}precision/{c}"] for c in classes) / len(classes)
        out[f"{prefix}macro_recall"] = sum(out[f"{prefix}recall/{c}"] for c in classes) / len(classes)
    return out
