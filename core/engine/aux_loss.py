"""Auxiliary losses: terms a module adds during its forward (MoE load balancing, router z-loss).

A module calls :func:`add_aux_loss` inside its ``forward``; the training loop collects every term of one
micro-batch's forward, adds their sum to the recipe's loss before the backward (so gradient accumulation,
loss scaling and the non-finite guard treat them like the loss) and reports each as ``aux/<name>``.
Outside a training forward (evaluation, generation, export) :func:`add_aux_loss` does nothing.
A term that is not a sum of per-layer terms (transformers' MoE balance loss multiplies router statistics pooled
over every layer) is added as statistics with :func:`add_pooled_aux_loss`, summed over the forward and finished
once when the forward ends.

Module metrics (:func:`add_metric`: an MoE layer's load, drop rate, router entropy) travel the same way: collected
per micro-batch, never differentiated, reported under their own name and averaged like the loss.
Both are a :class:`ForwardCollector`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

V = TypeVar("V")


class ForwardCollector(Generic[V]):
    """Named values that modules add during a forward, gathered by the ``with collect()`` block around it.

    A context variable carries the block's dict to the modules, so no module needs a reference to the loop;
    outside a block :meth:`add` does nothing. ``fold(previous, value)`` merges a name's repeated adds (one per
    layer; ``previous`` is None on the first).
    """

    def __init__(self, name: str, fold: Callable[[V | None, Any], V]) -> None:
        self._values: contextvars.ContextVar[dict[str, V] | None] = contextvars.ContextVar(name, default=None)
        self._fold = fold

    def add(self, name: str, value: Any) -> None:
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


def _sum_pooled(previous: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None,
                value: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    return value if previous is None else (previous[0] + value[0], previous[1])


_aux_losses: ForwardCollector[torch.Tensor] = ForwardCollector("crosstrain_aux_losses", _sum)
_pooled: ForwardCollector[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = ForwardCollector(
    "crosstrain_pooled_aux_losses", _sum_pooled)
_metrics: ForwardCollector[list[torch.Tensor]] = ForwardCollector("crosstrain_module_metrics", _append)


def add_aux_loss(name: str, value: torch.Tensor) -> None:
    """Add ``value`` (a scalar tensor, already multiplied by its coefficient) to this forward's term ``name``.

    Several calls with one name (one per layer) add up.
    """
    _aux_losses.add(name, value)


def add_pooled_aux_loss(name: str, stats: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Add ``stats`` to this forward's running sum for the term ``name``, which is ``finish(sum)`` (a scalar,
    coefficient included), computed once when the forward ends; ``finish`` runs on every rank that ran the
    forward, so it may all-reduce. Every call with one name must give the same ``finish`` (the first one is used).
    """
    _pooled.add(name, (stats, finish))


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[dict[str, torch.Tensor]]:
    """Collect the auxiliary losses added inside the ``with`` block into the yielded dict; pooled terms
    (:func:`add_pooled_aux_loss`) are finished and added when the block ends."""
    with _aux_losses.collect() as terms, _pooled.collect() as pooled:
        yield terms
    for name, (stats, finish) in pooled.items():
        terms[name] = finish(stats) if name not in terms else terms[name] + finish(stats)


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
