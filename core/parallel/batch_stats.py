"""Batch statistics under data parallelism: the protocol a module implements to observe the whole data-parallel batch.

A module whose state is a statistic of the training batch (a QAT activation observer's moving-average min/max)
sees only this rank's share of it under data parallelism, so N ranks would not compute what one process computes.
Such a module defines ``apply_data_parallel(group) -> None``: given the process group of this rank's data-parallel
peers (:func:`crosstrain.parallel.mesh.dp_group`), it reduces its statistic over ``group`` from then on.
``parallelize`` calls it on a trainable model when the data-parallel degree is above 1, never in a one-process
run. The module owns the reduction; core only finds the modules (as for :mod:`crosstrain.parallel.ep`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class DataParallelStats(Protocol):
    """A module that reduces a batch statistic over the data-parallel ranks (the conv QAT's activation observers)."""

    def apply_data_parallel(self, group: Any) -> None:
        """Reduce the statistic over the ranks of ``group`` (a ``ProcessGroup``) from now on."""
        ...


def apply_data_parallel(model: nn.Module, group: Any) -> int:
    """Call ``apply_data_parallel(group)`` on every submodule of ``model`` (itself included) that defines it;
    returns how many did. ``group`` None (data-parallel degree 1) calls nothing."""
    if group is None:
        return 0
    found = [m for m in model.modules() if isinstance(m, DataParallelStats)]
    for module in found:
        module.apply_data_parallel(group)
    return len(found)
