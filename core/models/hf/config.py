"""Hugging Face ``config.json`` <-> :class:`~crosstrain.models.gpt.GPTConfig` for the Llama family.

Llama, Mistral and Qwen2 decoders are the built-in GPT (RMSNorm, rotate-half rotary, SwiGLU, grouped-query
attention); Qwen2 adds biases on q/k/v (``GPTConfig.qkv_bias``); Mistral's and Qwen2's sliding windows are
``GPTConfig.sliding_window``/``layer_windows``; Gemma 2/3 live in :mod:`crosstrain.models.hf.gemma`. Anything the
GPT does not compute the same way (rope scaling, an output-projection bias, a head_dim that is not
``hidden / heads``) is refused with one line naming the config.json field, instead of importing a model that
silently differs.
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
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


def layer_windows(cfg: dict[str, Any], window: int, n_layers: int, where: str) -> tuple[int, ...]:
    """Per-layer windows from ``layer_types`` (``"sliding_attention"``: ``window``, ``"full_attention"``: 0), as
    transformers 5 configs list them; ``()`` when the config has none."""
    types = cfg.get("layer_types")
    if not types:
        return ()
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"{where}: layer_types must list 'sliding_attention'/'full_attention' once per layer "
                          f"({n_layers}); got {types}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _windows(cfg: dict[str, Any], model_type: str, n_layers: int, where: str) -> dict[str, Any]:
    """``sliding_window``/``layer_windows`` as transformers reads them: Mistral windows every layer; Qwen2 only
    with ``use_sliding_window``, on the layers ``layer_types`` marks (by default those from
    ``max_window_layers`` on: ``Qwen2Config.__post_init__``)."""
    window = int(cfg.get("sliding_window") or 0)
    if model_type != "qwen2":
        return {"sliding_window": window}
    if not cfg.get("use_sliding_window") or not window:
        return {}
    types = cfg.get("layer_types") or ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
                                       else "full_attention" for i in range(n_layers)]
    return {"layer_windows": layer_windows({"layer_types": types}, window, n_layers, where)}


def gpt_config_from_hf(cfg: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """The GPTConfig of a Llama/Mistral/Qwen2 ``config.json``; unsupported options are a one-line ConfigError."""
    model_type = cfg.get("model_type")
    if model_type in ("gemma2", "gemma3_text"):
        from crosstrain.models.hf.gemma import gemma_config_from_hf

        return gemma_config_from_hf(cfg, where)
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
    theta = _rope(cfg, where)
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        out = GPTConfig(
            vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2", **_windows(cfg, model_type, int(cfg["num_hidden_layers"]), where),
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
    """A ``config.json`` for ``cfg``: Gemma (:mod:`~crosstrain.models.hf.gemma`) with its sandwich norms, Qwen2
    when it has q/k/v biases, Mistral with a sliding window, else Llama (or ``base``'s model_type, whose other
    fields are kept, when ``base`` is the config the model was imported from)."""
    if cfg.sandwich_norm:
        from crosstrain.models.hf.gemma import hf_config_from_gemma

        return hf_config_from_gemma(cfg, base=base, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
    windowed = bool(cfg.sliding_window or any(cfg.layer_windows))
    model_type = "qwen2" if cfg.qkv_bias else "mistral" if windowed else "llama"
    out: dict[str, Any] = {}
    if (base is not None and base.get("model_type") in ("llama", "mistral", "qwen2")
            and (base["model_type"] == "qwen2") == cfg.qkv_bias and (base["model_type"] != "llama" or not windowed)):
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
        windows = cfg.layer_windows or (cfg.sliding_window,) * cfg.n_layers
        window = max(windows)
        if len({w for w in windows if w}) > 1:
            raise ValueError(f"Qwen2 has one sliding window size; this model has {sorted(set(windows))}")
        out.update({"use_sliding_window": bool(window), "sliding_window": window or None,
                    "layer_types": ["sliding_attention" if w else "full_attention" for w in windows]})
        if window:  # transformers' default layer_types start windows at max_window_layers
            out["max_window_layers"] = next(i for i, w in enumerate(windows) if w)
        out.pop("attention_bias")
    elif model_type == "mistral":
        if len(set(cfg.layer_windows)) > 1:
            raise ValueError(f"Mistral windows every layer alike; this model has {sorted(set(cfg.layer_windows))}")
        out["sliding_window"] = (cfg.layer_windows[0] if cfg.layer_windows else cfg.sliding_window) or None
    return out
