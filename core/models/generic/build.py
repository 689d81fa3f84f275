"""Build the generic model: ``AutoModelForCausalLM`` from a Hugging Face folder or a config.json dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.models.generic.config import GenericConfig, require_transformers
from crosstrain.models.generic.wrapper import GenericCausalLM, adopt


def hf_config_object(cfg: GenericConfig) -> Any:
    """transformers' config object for ``cfg.hf_config``."""
    transformers = require_transformers()
    data = {k: v for k, v in cfg.hf_config.items() if not k.startswith("_")}
    model_type = data.pop("model_type", "")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ConfigError(f"config.json model_type {model_type!r} is unknown to transformers "
                          f"{transformers.__version__} ({str(exc).splitlines()[0]}); upgrade transformers") from None


def build(cfg: GenericConfig) -> GenericCausalLM:
    """The model in fp32: ``cfg.init_from``'s weights (safetensors only, never a pickle), or random weights drawn
    from torch's generator (the run's seed) when the folder has none or there is no folder."""
    transformers = require_transformers()
    from crosstrain.models.hf.weights import INDEX, SINGLE, weight_files

    auto = transformers.AutoModelForCausalLM
    root = Path(cfg.init_from) if cfg.init_from else None
    has_weights = root is not None and ((root / INDEX).is_file() or (root / SINGLE).is_file()
                                        or any(root.glob("*.bin")) or any(root.glob("*.pth")))
    if has_weights:
        weight_files(root)  # refuses pickle-only folders and broken indexes in one line
    transformers.utils.logging.disable_progress_bar()  # crosstrain reports progress itself
    try:
        if has_weights:
            model = _load(cfg, auto)
        else:
            model = auto.from_config(hf_config_object(cfg), dtype=torch.float32)
    except ValueError as exc:  # a config class with no causal-LM head (an encoder, a vision model)
        raise _no_causal_lm(cfg, exc) from None
    return adopt(model.float().train())


def _no_causal_lm(cfg: GenericConfig, exc: ValueError) -> ConfigError:
    return ConfigError(f"transformers cannot build a causal LM for model_type {cfg.model_type!r} "
                       f"({str(exc).splitlines()[0]}); the generic path trains decoder-only causal LMs")


def _load(cfg: GenericConfig, auto: Any) -> nn.Module:
    """``cfg.init_from``'s weights, refused unless every tensor fits: transformers would initialise missing ones at
    random and drop unexpected ones, so a folder of one family under another's model_type would train from scratch.
    Its loading info already leaves out tied weights and the keys the model class ignores itself."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report is a table on stderr; the refusal below is the one line
    try:
        model, info = auto.from_pretrained(cfg.init_from, dtype=torch.float32, use_safetensors=True,
                                           output_loading_info=True)
    finally:
        logging.set_verbosity(verbosity)
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing or unexpected:
        parts = [f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ConfigError(f"model.init_from {cfg.init_from!r}: the weights do not fit transformers' "
                          f"{type(model).__name__} for model_type {cfg.model_type!r}: tensors {' and '.join(parts)}; "
                          "fix config.json's model_type/shape to the checkpoint's, or re-save the folder with "
                          "save_pretrained")
    return model  # type: ignore[no-any-return]


def meta_model(cfg: GenericConfig) -> nn.Module:
    """The model on the meta device (nothing allocated): for counting parameters."""
    transformers = require_transformers()
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config_object(cfg))
    except ValueError as exc:  # the layout estimate counts parameters before build() would refuse it
        raise _no_causal_lm(cfg, exc) from None
