"""The ``generic`` model family: every decoder-only causal LM transformers builds, on crosstrain's loop.

It claims a run when ``model.source = "transformers"``, or ``"auto"`` with a ``model.init_from`` Hugging Face
folder whose ``model_type`` no native family imports (:func:`crosstrain.models.family.native_model_types`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.models.family import ModelFamily, new_scalar_head
from crosstrain.models.generic import build as buildmod
from crosstrain.models.generic.config import GenericConfig, config_from_run, require_transformers
from crosstrain.models.generic.wrapper import GenericCausalLM


def claims(config: Any) -> bool:
    """``model.source = "transformers"``, or ``"auto"`` with an HF ``init_from`` of a non-native model_type."""
    m = config.model
    if m.import_path or m.source == "native":
        return False
    if m.source == "transformers":
        return True
    if not m.init_from:
        return False
    from crosstrain.checkpoint.resolve import source_kind
    from crosstrain.models.family import native_model_types
    from crosstrain.models.hf import read_hf_config

    if source_kind(m.init_from, what="model.init_from") != "hf":
        return False
    return str(read_hf_config(m.init_from).get("model_type")) not in native_model_types()


def check(cfg: GenericConfig, config: Any) -> None:
    """transformers importable, ``train.seq_len`` within the model's length, no packed documents, no pipeline."""
    require_transformers()
    if config.train.seq_len > cfg.max_seq_len:
        raise ConfigError(f"train.seq_len={config.train.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}; "
                          "lower train.seq_len or set model.max_seq_len")
    if config.data.packing == "documents":
        raise ConfigError("data.packing='documents' needs a native model (it passes document ids); the generic "
                          "(transformers) path takes data.packing='concat'")
    if config.data.path == "" and config.train.recipe == "lm" and 0 < cfg.vocab_size < 256:
        raise ConfigError(f"the model's vocab_size={cfg.vocab_size} is too small for the byte-level corpus (needs 256)")


def _config_class(cfg: GenericConfig) -> Any:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[cfg.model_type] if cfg.model_type in CONFIG_MAPPING else None


def validate_parallel(cfg: GenericConfig, dims: Any) -> None:
    """No pipeline split or expert parallelism; tensor parallelism only through the model's
    ``base_model_tp_plan``. ``cfg`` may also be a built model's transformers config (``parallelize`` passes it)."""
    if not isinstance(cfg, GenericConfig):
        cfg = GenericConfig(hf_config=cfg.to_dict())
    if dims.pp > 1:
        raise ConfigError(f"parallel.pp={dims.pp}: the generic (transformers) path has no pipeline split; set "
                          "parallel.pp=1 (or use a native family: crosstrain models)")
    if dims.ep > 1:
        raise ConfigError(f"parallel.ep={dims.ep}: the generic (transformers) path has no expert parallelism; set "
                          "parallel.ep=1")
    if dims.tp > 1:
        cls = _config_class(cfg)
        if not getattr(cls, "base_model_tp_plan", None):
            raise ConfigError(f"parallel.tp={dims.tp}: transformers' {cfg.model_type} has no base_model_tp_plan, so "
                              "the generic path cannot shard it; set parallel.tp=1")
        heads = int(cfg.hf_config.get("num_attention_heads") or 0)
        kv = int(cfg.hf_config.get("num_key_value_heads") or heads)
        if heads % dims.tp or kv % dims.tp:
            raise ConfigError(f"parallel.tp={dims.tp} must divide the attention heads ({heads}) and kv heads ({kv}) "
                              "of config.json; pick a divisor")


def param_count(cfg: GenericConfig) -> int:
    """Parameters counted on the meta device (tied weights once)."""
    return sum(p.numel() for p in buildmod.meta_model(cfg).parameters())


def _width(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[-1])  # type: ignore[operator]


def flops_per_token(model: nn.Module, seq_len: int, inactive: int) -> float:
    """6N + 12 L d T (PaLM's estimate, as the native GPT's): N without the input embedding, L decoder layers."""
    assert isinstance(model, GenericCausalLM)
    layers = len(model.ac_units())
    return 6 * (model.num_params(exclude_embeddings=True) - inactive) + 12 * layers * _width(model) * seq_len


def activation_bytes(cfg: GenericConfig, micro_batch: int, seq_len: int) -> int:
    """As the native GPT's (Korthikanti et al. 2022, 68 s b h bytes per fp32 layer) plus the fp32 logits."""
    h = cfg.hf_config
    width = int(h.get("hidden_size") or h.get("n_embd") or h.get("d_model") or 0)
    layers = int(h.get("num_hidden_layers") or h.get("n_layer") or h.get("num_layers") or 0)
    tokens = micro_batch * seq_len
    return 68 * tokens * width * layers + 3 * 4 * tokens * cfg.vocab_size


def scalar_head(model: nn.Module, init: str) -> None:
    """Replace the output embeddings by ``Linear(hidden, 1)`` (reward/value models), untied from the input ones."""
    old = model.get_output_embeddings()  # type: ignore[operator]
    dim = int(old.weight.shape[-1])
    head = new_scalar_head(dim, init)
    model.config.tie_word_embeddings = False  # type: ignore[union-attr]  # tie_weights() must not re-tie it
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}  # type: ignore[assignment]
    model.set_output_embeddings(head.to(old.weight.device))  # type: ignore[operator]


GENERIC_FAMILY = ModelFamily(
    name="generic",
    config_cls=GenericConfig,
    presets={},
    model_classes=(GenericCausalLM,),
    build=buildmod.build,
    config_from_run=config_from_run,
    check=check,
    validate_parallel=validate_parallel,
    param_count=param_count,
    flops_per_token=flops_per_token,
    activation_bytes=activation_bytes,
    scalar_head=scalar_head,
    claims=claims,
    path="generic",
    refuses=("parallel.pp > 1", "parallel.ep > 1", "parallel.tp > 1 without the model's base_model_tp_plan",
             "data.packing='documents'", "pickle-only weights (.bin/.pth)",
             "encoders (is_decoder=false) and encoder-decoders", "weights with missing or unexpected tensors"),
    parallel_dims=("dp_replicate", "dp_shard", "tp"),
)
