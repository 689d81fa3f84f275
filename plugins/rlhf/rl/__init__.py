"""Online RL for ``plugins/rlhf``: the ``grpo`` and ``ppo`` recipes and their composable loss parts (docs/rlhf.md).

The loss parts are pure functions, each selected by one ``[rl]`` option: :mod:`.advantages` (GAE, group, RLOO),
:mod:`.policy_loss` (ratio level, clipping), :mod:`.kl` (k1/k2/k3) and :mod:`.aggregate` (how per-token losses
become one number, with global token and sequence counts).
"""

from typing import Any


def recipes() -> dict[str, Any]:
    """``{name: recipe class}`` of the online RL recipes (imported on demand)."""
    from crosstrain.plugins.rlhf.rl.grpo import GRPORecipe
    from crosstrain.plugins.rlhf.rl.ppo import PPORecipe

    return {"grpo": GRPORecipe, "ppo": PPORecipe}
