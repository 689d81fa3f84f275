"""The layouts the federated-learning plugin refuses (``crosstrain_refusal_rules``, :mod:`crosstrain.config.rules`)."""

from __future__ import annotations

from crosstrain.config.rules import Rule

RULES = (
    Rule("fl-world", "fl", "`train.recipe = \"fl_client\"` on more than one process",
         "drop --nproc (run more clients instead)",
         lambda c, d: c.train.recipe == "fl_client" and d.world_size > 1,
         lambda c, d: f"an FL client trains in one process, not {d.world_size}"),
)
