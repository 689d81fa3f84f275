"""The plugin's hooks: the ``sft``, ``rm`` and ``dpo`` recipes and the ``[rlhf]`` config section."""

from __future__ import annotations

from typing import Any

from crosstrain import hookimpl

NAMES = ("sft", "rm", "dpo")


@hookimpl
def crosstrain_recipe(name: str) -> Any:
    if name in NAMES:
        from crosstrain.plugins.rlhf.recipes import RECIPES

        return RECIPES[name]()
    return None


@hookimpl
def crosstrain_recipe_names() -> list[str]:
    return list(NAMES)


@hookimpl
def crosstrain_config_sections() -> dict[str, type]:
    from crosstrain.plugins.rlhf.config import LoRASection, RLHFSection

    return {"rlhf": RLHFSection, "lora": LoRASection}


@hookimpl
def crosstrain_transform_model(model: Any, config: Any, name: str) -> Any:
    """``[lora] rank > 0``: adapters on the trainable model of the rlhf recipes (base frozen); a reward model's
    scalar head stays trainable. Other recipes and models are returned unchanged."""
    lora = config.section("lora")
    if not lora.rank or config.train.recipe not in NAMES:
        return model
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.rlhf.lora import add_lora

    if config.parallel.tp > 1:
        raise ConfigError("[lora] supports parallel.tp=1 (DDP/FSDP2); set parallel.tp=1 or lora.rank=0")
    if not add_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=list(lora.targets)):
        raise ConfigError(f"lora.targets={list(lora.targets)} matches no nn.Linear of model {name!r}; "
                          "use names such as wq, wk, wv, wo, w1, w2, w3")
    if config.train.recipe == "rm" and getattr(model, "output", None) is not None:
        model.output.requires_grad_(True)
    return model


@hookimpl(tryfirst=True)
def crosstrain_after_train(context: Any, run_dir: str) -> None:
    """``[lora]``: merge the adapters into the final weights before after-train exports (``export.safetensors``)
    read them, so the exported model is a plain GPT."""
    lora = context.config.section("lora")
    final = context.final_state_dict
    if lora.rank and final and any(k.endswith(".lora_A") for k in final):
        from crosstrain.plugins.rlhf.lora import merge_lora

        context.final_state_dict = merge_lora(final, lora.alpha / lora.rank)
