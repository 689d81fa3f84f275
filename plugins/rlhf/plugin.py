"""The plugin's hooks: the ``sft``, ``rm``, ``dpo``, ``grpo`` and ``ppo`` recipes, their config sections and
report panels."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl

NAMES = ("sft", "rm", "dpo")
RL_NAMES = ("grpo", "ppo")  # online RL, plugins/rlhf/rl
ADAPTED = ("policy", "reward")  # the trainable model of each recipe: the one LoRA adapts


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name in NAMES:
        from crosstrain.plugins.rlhf.recipes import RECIPES

        return RECIPES[name]()
    if name in RL_NAMES:
        from crosstrain.plugins.rlhf.rl import recipes as rl_recipes

        return rl_recipes()[name]()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return [*NAMES, *RL_NAMES]


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.rlhf.config import LoRASection, RLHFSection
    from crosstrain.plugins.rlhf.rl.config import RewardSection, RLSection

    return {"rlhf": RLHFSection, "lora": LoRASection, "rl": RLSection, "reward": RewardSection}


@hookimpl
def crosstrain_transform_model(model: Any, config: Any, name: str) -> Any:
    """``[lora] rank > 0``: adapters on the trainable model of the rlhf recipes (base frozen); a reward model's
    scalar head stays trainable. Other recipes and models are returned unchanged."""
    from crosstrain.errors import ConfigError

    lora = config.section("lora")
    if not lora.rank or config.train.recipe not in NAMES or name not in ADAPTED:
        return model  # (export rebuilds the run's model as "model" from weights with the adapters merged)
    from crosstrain.plugins.rlhf.lora import add_lora, lora_layers, no_match_error, output_head

    smallest = min((min(m.in_features, m.out_features) for _, m in lora_layers(model, list(lora.targets))), default=0)
    if smallest and lora.rank > smallest:  # a rank above a layer's smaller side adds parameters, not expressiveness
        raise ConfigError(f"lora.rank={lora.rank} exceeds the smallest adapted layer's dimension ({smallest}); set "
                          f"lora.rank <= {smallest}")
    if not add_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=list(lora.targets)):
        raise no_match_error(model, list(lora.targets), name)
    head = output_head(model)
    if config.train.recipe == "rm" and head is not None:
        head.requires_grad_(True)
    return model


@hookimpl
def crosstrain_export_state_dict(state_dict: dict[str, Any], config: Any) -> None:
    """Merge LoRA adapters (``X.lora_A`` / ``X.lora_B``) into plain weights before any export (``crosstrain export``
    of every format, ``export.safetensors`` after training), so the exported model is a plain GPT."""
    if not any(k.endswith(".lora_A") for k in state_dict):
        return
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.rlhf.lora import merge_lora

    lora = config.section("lora") if config is not None else None
    if lora is None or not lora.rank:
        raise ConfigError("these weights hold LoRA adapters but no run config with [lora] rank/alpha came with them; "
                          "export the run dir (it has config.toml) instead of the bare checkpoint")
    merged = merge_lora(state_dict, lora.alpha / lora.rank)
    state_dict.clear()
    state_dict.update(merged)


@hookimpl
def crosstrain_report_panels() -> list[Any]:
    """The rewards and KL the preference and RL recipes report, on ``crosstrain report``."""
    from crosstrain.plugins.observability.panels import Panel

    return [Panel("rlhf_rewards", "RLHF rewards", ("rewards/*",), "reward"),
            Panel("rlhf_kl", "RLHF KL to the reference", ("kl", "objective/kl", "*/kl"), "KL")]


@hookimpl
def crosstrain_refusal_rules() -> list[Any]:
    from crosstrain.plugins.rlhf.rules import RULES

    return list(RULES)
