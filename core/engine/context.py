"""``RunContext``: the small, typed view of a training run that every hook and recipe receives.

Hooks get this object instead of the Trainer (pytest/pluggy style: a hook sees exactly what it is documented
to see). Fields marked *stable* keep their name and meaning across releases; the others may grow.

Filled in stages, so a recipe's ``build_models`` sees the first group only:

- at build time: ``config``, ``recipe``, ``rank``, ``world_size``, ``local_rank``, ``dims``, ``mesh``,
  ``device``, ``backend``;
- once the models are parallelised: ``models``, ``optimizers``, ``model_config``; then ``run_dir`` and
  ``resume_step``;
- after training: ``summary``, ``final_state_dict``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crosstrain.config import Config
from crosstrain.parallel.dims import ParallelDims


@dataclass
class RunContext:
    """What a hook may read (and the few things it may do) during a run.

    Stable: ``config``, ``run_dir``, ``rank``, ``world_size``, ``dims``, ``mesh``, ``device``, ``models``,
    ``optimizers``, ``step``, ``emit_event``, ``request_stop``. Others: ``model_config``, ``summary``,
    ``final_state_dict`` (full fp32 CPU tensors of the primary model, on every rank, after training).
    """

    config: Config
    recipe: str
    rank: int
    world_size: int
    local_rank: int
    dims: ParallelDims
    device: torch.device
    backend: str
    mesh: Any = None
    run_dir: Path | None = None
    resume_step: int = 0
    models: Mapping[str, nn.Module] = field(default_factory=dict)
    optimizers: Mapping[str, torch.optim.Optimizer] = field(default_factory=dict)
    model_config: Any = None
    summary: dict[str, Any] = field(default_factory=dict)
    final_state_dict: dict[str, torch.Tensor] | None = None
    _step: Callable[[], int] = field(default=lambda: 0, repr=False)
    _emit: Callable[[int, str, dict[str, Any]], None] | None = field(default=None, repr=False)
    _stop: Callable[[str], None] | None = field(default=None, repr=False)

    def attach(
        self, step: Callable[[], int], emit: Callable[[int, str, dict[str, Any]], None], stop: Callable[[str], None]
    ) -> None:
        """Connect the loop's step counter, event sinks and stop request (a run without a loop has none)."""
        self._step, self._emit, self._stop = step, emit, stop

    @property
    def step(self) -> int:
        """Optimizer steps completed so far (the step a hook is called for, once it has run)."""
        return self._step()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def primary(self) -> str:
        """Name of the first trainable model: the one summary.json's ``params_sha256`` and exports describe."""
        return next(iter(self.optimizers), next(iter(self.models), ""))

    def emit_event(self, name: str, message: str = "", **fields: Any) -> None:
        """Record an event (``resume``, ``rollback``, ``preemption``, ``checkpoint_saved``, a plugin's own).

        Every metrics sink with an ``event(step, name, fields)`` method receives it, ``events.jsonl`` in the
        run dir keeps it, and ``message`` (if any) is printed on rank 0.
        """
        if self._emit is not None:
            self._emit(self.step, name, {"message": message, **fields} if message else dict(fields))
        elif message and self.is_main:
            print(message, file=sys.stderr, flush=True)

    def request_stop(self, reason: str) -> None:
        """Ask the loop to stop after this step as on SIGTERM: the ranks agree, save a checkpoint and exit 0."""
        if self._stop is not None:
            self._stop(reason)
