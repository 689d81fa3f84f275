"""Auxiliary losses: terms a module adds during its forward (MoE load balancing, router z-loss).

A module calls :func:`add_aux_loss` inside its ``forward``; the training loop collects every term of one
micro-batch's forward, adds their sum to the recipe's loss before the backward (so gradient accumulation,
loss scaling and the non-finite guard treat them like the loss) and reports each as ``aux/<name>``.
Outside a training forward (evaluation, generation, export) :func:`add_aux_loss` does nothing.

Module metrics (:func:`add_metric`: an MoE layer's load, drop rate, router entropy) travel the same way: collected
per micro-batch, never differentiated, reported under their own name and averaged like the loss.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_collector: contextvars.ContextVar[dict[str, torch.Tensor] | None] = contextvars.ContextVar(
    "crosstrain_aux_losses", default=None)
_metrics: contextvars.ContextVar[dict[str, list[torch.Tensor]] | None] = contextvars.ContextVar(
    "crosstrain_module_metrics", default=None)


def add_aux_loss(name: str, value: torch.Tensor) -> None:
    """Add ``value`` (a scalar tensor, already multiplied by its coefficient) to this forward's term ``name``.

    Several calls with one name (one per layer) add up.
    """
    terms = _collector.get()
    if terms is None:
        return
    terms[name] = terms[name] + value if name in terms else value


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[dict[str, torch.Tensor]]:
    """Collect the auxiliary losses added inside the ``with`` block into the yielded dict."""
    terms: dict[str, torch.Tensor] = {}
    token = _collector.set(terms)
    try:
        yield terms
    finally:
        _collector.reset(token)


def collecting() -> bool:
    """True inside a training forward (:func:`collect_aux_losses`): a module may then pay for extra work (a
    collective every rank runs) that only training needs."""
    return _collector.get() is not None


def add_metric(name: str, value: torch.Tensor | float) -> None:
    """Report ``value`` (a scalar, detached) as the metric ``name`` for this forward; several calls average."""
    values = _metrics.get()
    if values is None:
        return
    tensor = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    values.setdefault(name, []).append(tensor)


@contextlib.contextmanager
def collect_metrics() -> Iterator[dict[str, torch.Tensor]]:
    """Collect the metrics added inside the ``with`` block; the yielded dict holds each name's mean on exit."""
    values: dict[str, list[torch.Tensor]] = {}
    means: dict[str, torch.Tensor] = {}
    token = _metrics.set(values)
    try:
        yield means
    finally:
        _metrics.reset(token)
        for name, items in values.items():
            means[name] = torch.stack([t.to(items[0].device) for t in items]).mean()
