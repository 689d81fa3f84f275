"""The layouts the MoE plugin refuses (``crosstrain_refusal_rules``; the table is :mod:`crosstrain.config.rules`)."""

from __future__ import annotations

from typing import Any

from crosstrain.config.rules import Rule


def _experts(config: Any) -> int:
    from crosstrain.plugins.moe.imported import effective_section

    return int(effective_section(config).experts)


RULES = (
    Rule("moe-pp", "moe", "`moe.experts > 0` with `parallel.pp > 1`", "set parallel.pp=1",
         lambda c, d: _experts(c) > 0 and d.pp > 1,
         lambda c, d: f"moe.experts={_experts(c)} with parallel.pp={d.pp}: MoE balancing losses are not supported "
                      "under pipeline parallelism yet"),
    Rule("ep-no-experts", "moe", "`parallel.ep > 1` with the built-in GPT and `moe.experts = 0`",
         "set moe.experts to a multiple of parallel.ep, or parallel.ep=1",
         lambda c, d: d.ep > 1 and _experts(c) == 0 and not c.model.import_path,
         lambda c, d: f"parallel.ep={d.ep} splits MoE experts over ranks, but the model has none (moe.experts=0)"),
    Rule("ep-experts", "moe", "`parallel.ep` not dividing `moe.experts`", "pick a divisor",
         lambda c, d: d.ep > 1 and _experts(c) > 0 and _experts(c) % d.ep != 0,
         lambda c, d: f"parallel.ep={d.ep} must divide moe.experts={_experts(c)}"),
    Rule("ep-tp", "moe", "`moe.experts > 0` with `parallel.ep > 1` and `parallel.tp > 1`",
         "set parallel.tp=1 or parallel.ep=1",
         lambda c, d: _experts(c) > 0 and d.ep > 1 and d.tp > 1,
         lambda c, d: "moe layers with parallel.ep > 1 and parallel.tp > 1 together are not supported yet"),
)
