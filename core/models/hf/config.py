"""Hugging Face ``config.json`` <-> :class:`~crosstrain.models.gpt.GPTConfig` for the Llama family.

Llama, Mistral and Qwen2 decoders are the built-in GPT (RMSNorm, rotate-half rotary, SwiGLU, grouped-query
attention); Qwen2 adds biases on q/k/v (``GPTConfig.qkv_bias``). Anything the GPT does not compute the same way
(rope scaling, sliding windows, an output-projection bias, a head_dim that is not ``hidden / heads``) is refused
with one line naming the config.json field, instead of importing a model that silently differs.
Field meanings: transformers' ``LlamaConfig``, ``MistralConfig``, ``Qwen2Config`` (v4 ``rope_theta``/
``rope_scaling`` and v5 ``rope_parameters`` are both read).
"""

from __future__ import annotations

from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPTConfig

#: model_type -> the architecture name transformers' AutoModelForCausalLM maps it to.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _rope(cfg: dict[str, Any], where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        field = "rope_parameters.rope_type" if params.get("rope_type") else "rope_scaling"
        raise ConfigError(f"{where}: {field}={kind!r} is not supported (crosstrain implements plain rotary "
                          "embeddings only); use a checkpoint without rope scaling")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={cfg['partial_rotary_factor']} is not supported; "
                          "crosstrain rotates the whole head")
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def _no_sliding_window(cfg: dict[str, Any], model_type: str, where: str) -> None:
    if model_type == "qwen2":
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported (crosstrain's attention is full "
                              "causal); set it to false in config.json if the model was trained without it")
        return
    window = cfg.get("sliding_window")
    limit = int(cfg.get("max_position_embeddings", 0))
    if window is not None and int(window) < limit:
        raise ConfigError(f"{where}: sliding_window={window} is not supported (crosstrain's attention is full "
                          f"causal); use a checkpoint with sliding_window null (or >= max_position_embeddings={limit})")


def gpt_config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """The GPTConfig of a Llama/Mistral/Qwen2 ``config.json``; unsupported options are a one-line ConfigError."""
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not supported; crosstrain imports "
                          f"{', '.join(ARCHITECTURES)} checkpoints")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported; crosstrain's MLP is SwiGLU (silu)")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported; crosstrain's MLP has no biases")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported (it adds a bias to o_proj too); only "
                          "Qwen2's q/k/v biases are")
    _no_sliding_window(cfg, model_type, where)
    theta = _rope(cfg, where)
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        out = GPTConfig(
            vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
        )
    except KeyError as exc:
        raise ConfigError(f"{where} has no {exc.args[0]!r}; it is not a complete {model_type} config") from None
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise ConfigError(f"{where}: head_dim={head_dim} with num_attention_heads={heads} does not give "
                          f"hidden_size={dim}; crosstrain needs head_dim = hidden_size / num_attention_heads")
    return out


def hf_config_from_gpt(
    cfg: GPTConfig, *, base: dict[str, Any] | None = None, dtype: str = "float32",
    bos_id: int | None = None, eos_id: int | None = None,
) -> dict[str, Any]:
    """A ``config.json`` for ``cfg``: Qwen2 when it has q/k/v biases, else Llama (or ``base``'s model_type, whose
    other fields are kept, when ``base`` is the config the model was imported from)."""
    model_type = "qwen2" if cfg.qkv_bias else "llama"
    out: dict[str, Any] = {}
    if base is not None and base.get("model_type") in ARCHITECTURES and (base["model_type"] == "qwen2") == cfg.qkv_bias:
        model_type = str(base["model_type"])
        out.update({k: v for k, v in base.items() if not k.startswith("_")})
    else:
        out.update({"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None})
    out.update({
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,  # transformers >= 4.56 reads "dtype", older versions "torch_dtype"
    })
    if model_type == "qwen2":
        out.update({"use_sliding_window": False, "sliding_window": None})
        out.pop("attention_bias")
    elif model_type == "mistral":
        out["sliding_window"] = None
    return out
