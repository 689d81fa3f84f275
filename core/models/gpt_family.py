"""The built-in ``gpt`` family: :class:`~crosstrain.models.gpt.GPT`, its presets, its run-config reading, checks,
estimates, Hugging Face adapters (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, SmolLM3) and scalar head
(see :mod:`crosstrain.models.family`).

Its parallel plans are methods of its modules (``tp_plan`` on ``GPT``, ``Attention`` and ``FeedForward``;
``GPT.pipeline_split``; ``GPT.ac_units``: the blocks, which are also the FSDP2 units).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError
from crosstrain.models.family import ModelFamily, new_scalar_head
from crosstrain.models.gpt import GPT, PRESETS, GPTConfig
from crosstrain.models.hf.adapter import ADAPTERS
from crosstrain.models.rope import max_exact_len

#: the ``model.*`` keys that override a preset's shape (``vocab_size`` apart: it may follow the tokenizer)
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "tie_embeddings", "qkv_bias",
              "sliding_window")


def config_from_run(config: Any) -> GPTConfig:
    """``model.preset`` with the ``model.*`` overrides (vocabulary from ``data.tokenizer`` when set), or the shape
    of the ``model.init_from`` Hugging Face checkpoint."""
    m = config.model
    if m.init_from:
        from crosstrain.checkpoint.resolve import source_kind

        if source_kind(m.init_from, what="model.init_from") == "hf":
            return _pretrained_config(config)
        from crosstrain.models.init_chain import init_origin

        origin = init_origin(m.init_from)  # crosstrain weights: the shape of the run that saved them
        if origin is not None and not origin.model.get("import_path"):
            return _chained_config(config, origin)
    return preset_config(m.model_dump(), config.data.tokenizer)


def preset_config(model: dict[str, Any], tokenizer: str) -> GPTConfig:
    """A ``model`` section's ``preset`` with its shape keys; the vocabulary follows ``tokenizer`` (a
    ``data.tokenizer`` spec) unless ``vocab_size`` says otherwise."""
    base = PRESETS[model.get("preset") or "tiny"].to_dict()
    if tokenizer:
        from crosstrain.data.hf_tokenizer import describe_tokenizer

        base["vocab_size"] = describe_tokenizer(tokenizer)["vocab_size"]
    base.update({k: model[k] for k in ("vocab_size", *SHAPE_KEYS) if model.get(k) is not None})
    return GPTConfig(**base)


def origin_config(origin: Any) -> GPTConfig:
    """The GPTConfig an :class:`~crosstrain.models.init_chain.Origin` states: its Hugging Face folder's
    config.json, or its first run's ``model.*`` keys; the nearest link's ``max_seq_len``."""
    from crosstrain.models.hf import pretrained_config

    if origin.hf_folder is not None:
        cfg = pretrained_config(origin.hf_folder)
    else:
        cfg = preset_config(origin.model, origin.tokenizer)
    return dataclasses.replace(cfg, max_seq_len=int(origin.max_seq_len)) if origin.max_seq_len else cfg


def _chained_config(config: Any, origin: Any) -> GPTConfig:
    """``model.init_from`` = a run (or its checkpoint): that run's shape; a ``model.*`` key may repeat it (only
    ``max_seq_len`` may change it)."""
    m = config.model
    cfg = origin_config(origin)
    if m.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=m.max_seq_len)
    effective = {**dataclasses.asdict(cfg), "n_kv_heads": cfg.kv_heads, "ffn_dim": cfg.hidden_dim}
    for key in ("vocab_size", *SHAPE_KEYS):
        value = getattr(m, key)
        if key != "max_seq_len" and value is not None and value != effective.get(key, value):
            raise ConfigError(f"model.{key}={value} does not match model.init_from {m.init_from}, whose model has "
                              f"{shape_text(cfg)} (from {origin.describe()}); remove model.{key}")
    return cfg


def shape_text(cfg: GPTConfig) -> str:
    """``vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128``: a shape for messages."""
    shape = {"vocab_size": cfg.vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
             "n_kv_heads": cfg.kv_heads, "ffn_dim": cfg.hidden_dim}
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def _pretrained_config(config: Any) -> GPTConfig:
    """``model.init_from``: the shape is the checkpoint's config.json; only ``max_seq_len`` may be changed."""
    from crosstrain.models.hf import pretrained_config

    m = config.model
    fixed = [k for k in ("vocab_size", *SHAPE_KEYS) if k != "max_seq_len" and getattr(m, k) is not None]
    if fixed:
        raise ConfigError(
            f"model.{fixed[0]} cannot be combined with model.init_from (the shape comes from "
            f"{m.init_from}/config.json); remove model.{fixed[0]}"
        )
    cfg = pretrained_config(m.init_from)
    return dataclasses.replace(cfg, max_seq_len=m.max_seq_len) if m.max_seq_len else cfg


def check(cfg: GPTConfig, config: Any) -> None:
    """The shape against itself, ``train.seq_len`` and the byte-level corpus."""
    if cfg.dim % cfg.n_heads and not cfg.attn_head_dim:
        raise ConfigError(f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"model.n_heads={cfg.n_heads} must be divisible by model.n_kv_heads={cfg.kv_heads}")
    limit = max_exact_len(cfg.rope_scaling)
    if limit is not None and cfg.max_seq_len > limit:
        kind = cfg.rope_scaling["rope_type"] if cfg.rope_scaling else ""
        raise ConfigError(f"model.max_seq_len={cfg.max_seq_len} exceeds {limit}, the context within which "
                          f"rope_parameters.rope_type={kind!r} has fixed frequencies (transformers rescales them "
                          f"for longer sequences); set model.max_seq_len <= {limit}")
    if config.train.seq_len > cfg.max_seq_len:
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}; "
            "lower train.seq_len or set model.max_seq_len"
        )
    if config.data.path == "" and cfg.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is too small for the byte-level corpus (needs 256)")


def validate_parallel(cfg: GPTConfig, dims: Any) -> None:
    """Tensor parallelism shards heads, kv heads, the MLP's hidden size and the vocabulary; pipeline stages take
    whole blocks and cannot share tied embeddings."""
    if dims.tp > 1:
        tp = dims.tp
        if cfg.n_heads % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.n_heads={cfg.n_heads}; pick a divisor")
        if cfg.kv_heads % tp:
            raise ConfigError(f"parallel.tp={tp} must divide the kv heads ({cfg.kv_heads}); pick a divisor")
        if cfg.hidden_dim % tp:
            raise ConfigError(f"parallel.tp={tp} must divide the model's ffn hidden size {cfg.hidden_dim}")
        if cfg.vocab_size % tp:
            raise ConfigError(f"parallel.tp={tp} must divide model.vocab_size={cfg.vocab_size}; pad the vocabulary")
    if dims.pp > 1:
        if dims.pp > cfg.n_layers:
            raise ConfigError(f"parallel.pp={dims.pp} exceeds model.n_layers={cfg.n_layers}; use pp <= n_layers")
        if cfg.tie_embeddings:
            raise ConfigError("parallel.pp > 1 cannot split tied embeddings; set model.tie_embeddings=false")


def param_count(cfg: GPTConfig) -> int:
    """Parameters of the GPT with this config, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model: nn.Module, seq_len: int, inactive: int) -> float:
    """The GPT's own estimate (6N + attention, PaLM's) less ``6 * inactive`` for parameters a token skips."""
    assert isinstance(model, GPT)
    return model.flops_per_token(seq_len) - 6 * inactive


def activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int) -> int:
    """Activations of one fp32 training step (Korthikanti et al. 2022, sec. 4.1: about ``34 s b h`` bytes per layer
    in 16-bit, so ``68 s b h`` in fp32, with the ``5 a s^2 b`` attention term dropped because crosstrain uses
    scaled_dot_product_attention) plus the logits (fp32 logits, their softmax and gradient)."""
    tokens = seq_len * micro_batch
    return 68 * tokens * cfg.dim * cfg.n_layers + 3 * 4 * tokens * cfg.vocab_size


def scalar_head(model: nn.Module, init: str) -> None:
    """Replace ``output`` by ``Linear(dim, 1, bias=False)``: ``init`` ``"normal"`` (std ``dim**-0.5``, a reward
    model), ``"zeros"`` (a value model that starts at V = 0) or ``"default"`` (torch's; weights loaded next).
    The config is marked untied, so tensor parallelism's ``tie_weights()`` never puts the embedding back."""
    assert isinstance(model, GPT)
    if model.output is None:
        raise ConfigError(
            "the scalar head replaces the LM head, which this pipeline stage does not hold; "
            "swap the head before the pipeline split"
        )
    dim = model.config.dim
    head = new_scalar_head(dim, init)
    model.output = head
    model.config = dataclasses.replace(model.config, tie_embeddings=False)


GPT_FAMILY = ModelFamily(
    name="gpt",
    config_cls=GPTConfig,
    presets=PRESETS,
    model_classes=(GPT,),
    build=GPT,
    config_from_run=config_from_run,
    check=check,
    validate_parallel=validate_parallel,
    param_count=param_count,
    flops_per_token=flops_per_token,
    activation_bytes=activation_bytes,
    hf_adapters=ADAPTERS,
    scalar_head=scalar_head,
    refuses=("rope types other than default/llama3/linear/dynamic/yarn/longrope",
             "dynamic/longrope rope beyond the original context", "partial_rotary_factor outside phi3",
             "hidden_act other than silu (gelu-tanh for Gemma)", "Gemma's use_bidirectional_attention",
             "pickle-only weights (.bin/.pth)",
             "parallel.pp > 1 with tied embeddings"),
)
