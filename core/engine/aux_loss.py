"""Auxiliary losses: terms a module adds during its forward (MoE load balancing, router z-loss).

A module calls :func:`add_aux_loss` inside its ``forward``; the training loop collects every term of one
micro-batch's forward, adds their sum to the recipe's loss before the backward (so gradient accumulation,
loss scaling and the non-finite guard treat them like the loss) and reports each as ``aux/<name>``.
Outside a training forward (evaluation, generation, export) :func:`add_aux_loss` does nothing.

Module metrics (:func:`add_metric`: an MoE layer's load, drop rate, router entropy) travel the same way: collected
per micro-batch, never differentiated, reported under their own name and averaged like the loss.
Both are a :class:`ForwardCollector`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


class ForwardCollector(Generic[V]):
    """Named values that modules add during a forward, gathered by the ``with collect()`` block around it.

    A context variable carries the block's dict to the modules, so no module needs a reference to the loop;
    outside a block :meth:`add` does nothing. ``fold(previous, value)`` merges a name's repeated adds (one per
    layer; ``previous`` is None on the first).
    """

    def __init__(self, name: str, fold: Callable[[V | None, torch.Tensor], V]) -> None:
        self._values: contextvars.ContextVar[dict[str, V] | None] = contextvars.ContextVar(name, default=None)
        self._fold = fold

    def add(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` into this forward's ``name``; a no-op outside :meth:`collect`."""
        values = self._values.get()
        if values is not None:
            values[name] = self._fold(values.get(name), value)

    def active(self) -> bool:
        """Whether a :meth:`collect` block is open (in this context)."""
        return self._values.get() is not None

    @contextlib.contextmanager
    def collect(self) -> Iterator[dict[str, V]]:
        """Collect the values added inside the ``with`` block into the yielded dict (filled as they come)."""
        values: dict[str, V] = {}
        token = self._values.set(values)
        try:
            yield values
        finally:
            self._values.reset(token)


def _sum(previous: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if previous is None else previous + value


def _append(previous: list[torch.Tensor] | None, value: torch.Tensor) -> list[torch.Tensor]:
    if previous is None:
        return [value]
    previous.append(value)
    return previous


_aux_losses: ForwardCollector[torch.Tensor] = ForwardCollector("crosstrain_aux_losses", _sum)
_metrics: ForwardCollector[list[torch.Tensor]] = ForwardCollector("crosstrain_module_metrics", _append)


def add_aux_loss(name: str, value: torch.Tensor) -> None:
    """Add ``value`` (a scalar tensor, already multiplied by its coefficient) to this forward's term ``name``.

    Several calls with one name (one per layer) add up.
    """
    _aux_losses.add(name, value)


def collect_aux_losses() -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
    """Collect the auxiliary losses added inside the ``with`` block into the yielded dict."""
    return _aux_losses.collect()


def collecting() -> bool:
    """True inside a training forward (:func:`collect_aux_losses`): a module may then pay for extra work (a
    collective every rank runs) that only training needs."""
    return _aux_losses.active()


def add_metric(name: str, value: torch.Tensor | float) -> None:
    """Report ``value`` (a scalar, detached) as the metric ``name`` for this forward; several calls average."""
    if _metrics.active():
        tensor = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        _metrics.add(name, tensor)


@contextlib.contextmanager
def collect_metrics() -> Iterator[dict[str, torch.Tensor]]:
    """Collect the metrics added inside the ``with`` block; the yielded dict holds each name's mean on exit."""
    means: dict[str, torch.Tensor] = {}
    with _metrics.collect() as values:
        try:
            yield means
        finally:
            for name, items in values.items():
                means[name] = torch.stack([t.to(items[0].device) for t in items]).mean()
