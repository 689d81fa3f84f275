"""Learning-rate schedules: linear warmup, then cosine or linear decay to ``min_lr_ratio * lr`` (or constant).

:class:`LRSchedule` sets the lr of every param group itself and checkpoints as ``{"step": n}``, so its state
is plain JSON (no pickled lambdas).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, name: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for the optimizer step with 0-based index ``step``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if name == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif name == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown schedule {name!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class LRSchedule:
    """Call :meth:`apply` before each optimizer step; :meth:`step` after it."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule_cfg: Any, total_steps: int) -> None:
        self.optimizer = optimizer
        self.cfg = schedule_cfg
        self.total_steps = total_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.steps_done = 0
        self.apply()

    def factor(self) -> float:
        return lr_factor(self.steps_done, total_steps=self.total_steps, warmup_steps=self.cfg.warmup_steps,
                         name=self.cfg.name, min_lr_ratio=self.cfg.min_lr_ratio)

    def apply(self) -> float:
        """Set the lr of the upcoming step on every param group; returns the first group's lr."""
        factor = self.factor()
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        return self.base_lrs[0] * factor

    def step(self) -> None:
        self.steps_done += 1
        self.apply()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["step"])
        self.apply()


def build_schedule(optimizer: torch.optim.Optimizer, schedule_cfg: Any, total_steps: int) -> LRSchedule:
    return LRSchedule(optimizer, schedule_cfg, total_steps)
