"""KL estimators between the policy and a frozen reference on the policy's own samples, and the adaptive KL
controller of Ziegler et al. 2019."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KLEstimator = "k3",
                clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (J. Schulman, "Approximating KL
    Divergence", 2020), with ``log r = ref_logp - logp`` clamped to ``[-clamp, clamp]`` and the estimate too:

    ``k1 = -log r`` (unbiased, high variance), ``k2 = (log r)^2 / 2`` (biased, low variance),
    ``k3 = (r - 1) - log r`` (unbiased, low variance, always >= 0; GRPO's choice, Shao et al. 2024).
    ``clamp=0`` turns clamping off.
    """
    log_r = ref_logps - logps
    if clamp:
        log_r = log_r.clamp(-clamp, clamp)
    if estimator == "k1":
        out = -log_r
    elif estimator == "k2":
        out = 0.5 * log_r**2
    elif estimator == "k3":
        out = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"estimator={estimator!r} is not one of k1, k2, k3")
    return out.clamp(-clamp, clamp) if clamp else out


class AdaptiveKLController:
    """Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"), as TRL's ``AdaptiveKLController``:
    ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n / horizon)`` after each batch of ``n``
    samples. ``target=0`` keeps ``beta`` fixed. Checkpointed (``state_dict``) so a resumed run continues with
    the same coefficient."""

    def __init__(self, beta: float, target: float = 0.0, horizon: float = 10000.0) -> None:
        self.beta, self.target, self.horizon = float(beta), float(target), float(horizon)

    def update(self, kl: float, n: int) -> float:
        if self.target and math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + error * n / self.horizon
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])
