"""The combinations the rlhf plugin refuses (``crosstrain_refusal_rules``; the table is
:mod:`crosstrain.config.rules`). Pipeline parallelism needs no rule here: these recipes do not declare
``supports_pipeline``, which the core's ``pp-recipe`` rule reads."""

from __future__ import annotations

from typing import Any

from crosstrain.config.rules import Rule

#: the recipes whose trainable model ``[lora]`` adapts (plugins/rlhf/plugin.py)
LORA_RECIPES = ("sft", "rm", "dpo")
#: recipes that pad pairs or sample prompts: their rows are never packed into documents
UNPACKED = ("sft", "rm", "dpo", "grpo", "ppo")
#: recipes whose scalar head (reward, value) replaces the LM head, which tensor parallelism shards
SCALAR_HEAD = ("rm", "ppo")
#: the online RL recipes (plugins/rlhf/rl): a micro-batch holds whole groups of completions
RL_RECIPES = ("grpo", "ppo")


def _rank(config: Any) -> int:
    return int(config.section("lora").rank)


def _micro(config: Any, dims: Any) -> int:
    """Completions per micro-batch of an RL recipe (``train.batch_size`` counts completions)."""
    return int(config.train.batch_size // (dims.dp_degree * config.train.grad_accum))


def _experts(config: Any) -> int:
    """``moe.experts``, 0 without the MoE plugin."""
    return int(getattr(config.plugins.get("moe"), "experts", 0))


def _groups(config: Any) -> int:
    return int(config.section("rl").num_generations)


RULES = (
    Rule("lora-recipe", "rlhf", "`lora.rank > 0` with a recipe other than sft, rm, dpo",
         "set lora.rank=0 or --recipe sft, rm or dpo",
         lambda c, d: _rank(c) > 0 and c.train.recipe not in LORA_RECIPES,
         lambda c, d: f"lora.rank={_rank(c)} adapts the sft, rm and dpo recipes only; train.recipe="
                      f"{c.train.recipe!r} would ignore it"),
    Rule("lora-tp", "rlhf", "`lora.rank > 0` with `parallel.tp > 1`", "set parallel.tp=1 or lora.rank=0",
         lambda c, d: _rank(c) > 0 and c.train.recipe in LORA_RECIPES and d.tp > 1,
         lambda c, d: f"[lora] supports parallel.tp=1 (DDP/FSDP2), not parallel.tp={d.tp}"),
    Rule("unpacked-recipe", "rlhf", "`data.packing = \"documents\"` with sft, rm, dpo, grpo or ppo",
         "set data.packing='concat'",
         lambda c, d: c.data.packing == "documents" and c.train.recipe in UNPACKED,
         lambda c, d: f"--recipe {c.train.recipe} pads its rows and does not pack documents"),
    Rule("head-tp", "rlhf", "`--recipe rm` or `ppo` with `parallel.tp > 1`", "set parallel.tp=1",
         lambda c, d: c.train.recipe in SCALAR_HEAD and d.tp > 1,
         lambda c, d: f"--recipe {c.train.recipe} replaces the LM head with a scalar head, which parallel.tp="
                      f"{d.tp} cannot shard"),
    # stop-gap: generation unshards FSDP groups and calls the experts module directly, which lazily initialises
    # the experts' own FSDP group (ep > 1) as a root before the policy's first forward; FSDP then refuses it
    Rule("rl-ep", "rlhf", "grpo or ppo with `moe.experts > 0` and `parallel.ep > 1`",
         "set parallel.ep=1 (experts replicated) or moe.experts=0",
         lambda c, d: c.train.recipe in RL_RECIPES and d.ep > 1 and _experts(c) > 0,
         lambda c, d: f"--recipe {c.train.recipe} samples rollouts, which do not run on experts split over "
                      f"parallel.ep={d.ep} ranks yet"),
    Rule("rl-groups", "rlhf", "grpo or ppo whose micro-batch (`batch_size / (dp x grad_accum)`) is not a multiple "
         "of `rl.num_generations`", "change one of them",
         lambda c, d: c.train.recipe in RL_RECIPES and (_micro(c, d) % _groups(c) != 0 or _micro(c, d) == 0),
         lambda c, d: f"train.batch_size={c.train.batch_size} counts completions: each micro-batch (batch_size / "
                      f"(dp={d.dp_degree} x grad_accum={c.train.grad_accum}) = {_micro(c, d)}) must be a multiple of "
                      f"rl.num_generations={_groups(c)}"),
)
