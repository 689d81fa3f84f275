"""Loop state checkpointed with the models: progress counters, data position and loss scale."""

from __future__ import annotations

import math
from typing import Any

from crosstrain.data import DistributedBatchSampler
from crosstrain.engine.loss_scale import DynamicLossScaler


class Counters:
    """Trainer progress that is checkpointed with the model (same on every rank)."""

    def __init__(self) -> None:
        self.step = 0
        self.nonfinite_steps = 0
        self.rollbacks = 0
        self.initial_loss = float("nan")
        self.best_eval_loss = float("nan")  # the lowest eval loss so far and its step (0: none yet)
        self.best_eval_step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "nonfinite_steps": self.nonfinite_steps, "rollbacks": self.rollbacks,
                "initial_loss": self.initial_loss, "best_eval_loss": self.best_eval_loss,
                "best_eval_step": self.best_eval_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.nonfinite_steps = int(state["nonfinite_steps"])
        self.rollbacks = int(state["rollbacks"])
        self.initial_loss = float(state["initial_loss"])
        self.best_eval_loss = float(state.get("best_eval_loss", float("nan")))
        self.best_eval_step = int(state.get("best_eval_step", 0))

    def record_eval(self, step: int, loss: float) -> bool:
        """Remember ``loss`` if it is the best so far; True when it is."""
        if math.isfinite(loss) and not (loss >= self.best_eval_loss):  # nan best: the first finite one wins
            self.best_eval_loss, self.best_eval_step = loss, step
            return True
        return False


class DataState:
    """Data position and loss scale: the same on every rank, so saved once and restored under any layout."""

    def __init__(self, sampler: DistributedBatchSampler, scaler: DynamicLossScaler) -> None:
        self.sampler, self.scaler = sampler, scaler

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.scaler.load_state_dict(state["scaler"])
