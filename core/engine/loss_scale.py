"""Dynamic loss scaling for fp16 (the engine scales the loss; gradients are unscaled before clipping)."""

from __future__ import annotations

from typing import Any


class DynamicLossScaler:
    """Halve the scale on an overflow (the step is skipped); double it after ``growth_interval`` good steps."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def unscale_(self, params: Any) -> None:
        if not self.enabled or self.scale == 1.0:
            return
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
