"""Hugging Face ``config.json`` <-> :class:`~crosstrain.models.gpt.GPTConfig` for the Llama-shaped families.

Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 and SmolLM3 decoders are the built-in GPT (RMSNorm, rotate-half rotary,
SwiGLU, grouped-query attention) with options: q/k/v biases (Qwen2, ``attention_bias``), an o_proj bias
(``attention_bias``), MLP biases (``mlp_bias``), q/k RMSNorm per head (Qwen3) or over the projection (OLMo 2),
post-sublayer norms (OLMo 2), partial rotary (Phi-3's ``partial_rotary_factor``), NoPE layers (SmolLM3's
``no_rope_layers``), an explicit ``head_dim``, the rope variants of :mod:`crosstrain.models.rope` and sliding windows
(``sliding_window``, ``use_sliding_window``/``max_window_layers``/``layer_types``: ``GPTConfig.sliding_window`` and
``layer_windows``); Gemma 2/3 live in :mod:`crosstrain.models.hf.gemma`. Anything the GPT does not compute the same
way (other activations, other rope types) is refused with one line naming the config.json field, instead of
importing a model that silently differs. Field meanings: transformers'
``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Phi3Config``, ``Olmo2Config``,
``SmolLM3Config`` (v4 ``rope_theta``/``rope_scaling`` and v5 ``rope_parameters`` are both read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPTConfig
from crosstrain.models.hf.fields import DeclaredFields
from crosstrain.models.rope import ROPE_TYPES

#: model_type -> the architecture name transformers' AutoModelForCausalLM maps it to.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
#: families whose transformers module reads ``attention_bias`` (q/k/v/o biases) and ``mlp_bias``
_ATTENTION_BIAS = ("llama", "qwen3", "olmo2", "smollm3")
_MLP_BIAS = ("llama", "smollm3")
#: keys each rope_type needs (after the defaults transformers' ``standardize_rope_params`` fills in)
_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}


def _rope(cfg: Mapping[str, Any], model_type: str, where: str) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, scaling, partial_rotary_factor)`` as transformers resolves them (``rope_scaling`` wins over
    ``rope_parameters``; ``original_max_position_embeddings`` and a missing yarn/longrope ``factor`` filled in)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    src = dict(scaling or params)
    field = "rope_scaling" if scaling else "rope_parameters.rope_type"
    kind = src.get("rope_type") or src.get("type") or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):  # Phi3Config's backward compatibility
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: {field}={kind!r} is not supported; crosstrain computes rope_type "
                          f"{', '.join(ROPE_TYPES)}")
    theta = float(src.get("rope_theta") or params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    fraction = float(src.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
    if fraction != 1.0 and model_type != "phi3":
        raise ConfigError(f"{where}: partial_rotary_factor={fraction} is not supported for {model_type} (its "
                          "transformers module rotates the whole head); only phi3 rotates part of it")
    if kind == "default":
        return theta, None, fraction
    missing = [k for k in _ROPE_KEYS[kind] if src.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: rope_type={kind!r} needs rope_parameters.{missing[0]}; add it to config.json")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    out = {k: v for k, v in src.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    out["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):
        # a top-level field wins over rope_parameters' own (transformers' standardize_rope_params)
        top = cfg.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
        out["original_max_position_embeddings"] = int(top or src.get("original_max_position_embeddings") or max_pos)
        if out.get("factor") is None:  # yarn/longrope: the ratio of the context lengths
            out["factor"] = max_pos / out["original_max_position_embeddings"]
    elif kind == "dynamic":  # its frequencies are the plain ones up to max_position_embeddings (crosstrain.models.rope)
        out["original_max_position_embeddings"] = max_pos
    return theta, out, fraction


def layer_windows(cfg: Mapping[str, Any], window: int, n_layers: int, where: str) -> tuple[int, ...]:
    """Per-layer windows from ``layer_types`` (``"sliding_attention"``: ``window``, ``"full_attention"``: 0), as
    transformers 5 configs list them; ``()`` when the config has none."""
    types = cfg.get("layer_types")
    if not types:
        return ()
    if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConfigError(f"{where}: layer_types must list 'sliding_attention'/'full_attention' once per layer "
                          f"({n_layers}); got {types}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _windows(cfg: Mapping[str, Any], model_type: str, nope: tuple[int, ...], where: str) -> dict[str, Any]:
    """``sliding_window``/``layer_windows`` as transformers reads them: Mistral and Phi-3 window every layer; Qwen2,
    Qwen3 and SmolLM3 only with ``use_sliding_window``, on the layers ``layer_types`` marks (by default Qwen's from
    ``max_window_layers`` on, SmolLM3's NoPE layers: their configs' ``__post_init__``)."""
    if model_type not in ("mistral", "phi3", "qwen2", "qwen3", "smollm3"):  # Llama and OLMo 2 read no window
        return {}
    window = int(cfg.get("sliding_window") or 0)
    n_layers = int(cfg["num_hidden_layers"])
    if model_type in ("mistral", "phi3"):
        return {"sliding_window": window}
    if not cfg.get("use_sliding_window") or not window:
        return {}
    types = cfg.get("layer_types")
    if not types and model_type == "smollm3":
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(n_layers)]
    if not types:
        types = ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
                 for i in range(n_layers)]
    return {"layer_windows": layer_windows({"layer_types": types}, window, n_layers, where)}


def _nope_layers(cfg: Mapping[str, Any], n_layers: int) -> tuple[int, ...]:
    """SmolLM3's ``no_rope_layers`` (1 = rotary, 0 = NoPE per layer; default: NoPE every ``no_rope_layer_interval``-th
    layer, as SmolLM3Config builds it) -> the NoPE layer indices."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    return tuple(i for i, flag in enumerate(flags) if not flag)


def ignored_dropout(cfg: dict[str, Any]) -> dict[str, float]:
    """The non-zero dropout probabilities of a ``config.json`` (``attention_dropout``, ``hidden_dropout``,
    ``resid_pdrop``, ...): the native GPT has no dropout, so training from it does not apply them."""
    return {k: float(v) for k, v in cfg.items()
            if ("dropout" in k or k.endswith("_pdrop")) and isinstance(v, int | float) and not isinstance(v, bool)
            and float(v) > 0}


def gpt_config_from_hf(cfg: Mapping[str, Any], where: str = "config.json") -> GPTConfig:
    """The GPTConfig of a ``config.json`` of a family in :data:`ARCHITECTURES`; unsupported options are a one-line
    ConfigError naming the field. Only the family's fields in :data:`~crosstrain.models.hf.fields.READS` are read."""
    model_type = cfg.get("model_type")
    if model_type in ("gemma2", "gemma3_text"):
        from crosstrain.models.hf.gemma import gemma_config_from_hf

        return gemma_config_from_hf(cfg, where)
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not supported; crosstrain imports "
                          f"{', '.join(ARCHITECTURES)} checkpoints")
    cfg = DeclaredFields(cfg, str(model_type))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported; crosstrain's MLP is SwiGLU (silu)")
    attention_bias = model_type in _ATTENTION_BIAS and bool(cfg.get("attention_bias"))
    theta, scaling, fraction = _rope(cfg, model_type, where)
    try:
        dim, heads, n_layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or dim // heads)
        nope = _nope_layers(cfg, n_layers) if model_type == "smollm3" else ()
        out = GPTConfig(
            vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)), rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias, rope_scaling=scaling, rotary_fraction=fraction,
            attn_head_dim=head_dim if head_dim * heads != dim else 0,
            qk_norm={"qwen3": "head", "olmo2": "proj"}.get(model_type, ""), out_bias=attention_bias,
            mlp_bias=model_type in _MLP_BIAS and bool(cfg.get("mlp_bias")), post_norm=model_type == "olmo2",
            nope_layers=nope, **_windows(cfg, model_type, nope, where),
        )
    except KeyError as exc:
        raise ConfigError(f"{where} has no {exc.args[0]!r}; it is not a complete {model_type} config") from None
    rotary = out.head_dim * fraction
    if rotary != int(rotary) or int(rotary) % 2:
        raise ConfigError(f"{where}: partial_rotary_factor={fraction} with head_dim={out.head_dim} gives "
                          f"{rotary} rotary channels; crosstrain needs an even whole number")
    if scaling is not None and scaling["rope_type"] == "longrope" and out.max_seq_len > scaling[
            "original_max_position_embeddings"]:  # the table is exact up to the original context (models/rope.py)
        from dataclasses import replace

        out = replace(out, max_seq_len=int(scaling["original_max_position_embeddings"]))
    return out


def _features(cfg: GPTConfig) -> tuple[Any, ...]:
    return (cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias, cfg.qk_norm, cfg.post_norm, cfg.rotary_fraction,
            cfg.nope_layers, _layer_windows(cfg))


def _layer_windows(cfg: GPTConfig) -> tuple[int, ...]:
    return tuple(cfg.window_of(i) for i in range(cfg.n_layers))


def _model_type(cfg: GPTConfig) -> str:
    """The transformers family that computes what ``cfg`` does (for a model not imported from one)."""
    if cfg.post_norm or cfg.qk_norm == "proj":
        return "olmo2"
    if cfg.qk_norm == "head":
        return "qwen3"
    if cfg.rotary_fraction != 1.0:
        return "phi3"
    if cfg.nope_layers:
        return "smollm3"
    if cfg.qkv_bias and not cfg.out_bias:
        return "qwen2"
    return "mistral" if any(_layer_windows(cfg)) else "llama"


def _window_fields(cfg: GPTConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields that give ``cfg``'s sliding windows back to ``model_type`` (see :func:`_windows`)."""
    windows = _layer_windows(cfg)
    sizes = {w for w in windows if w}
    if not sizes:
        return {}
    if len(sizes) > 1:
        raise ValueError(f"{model_type} has one sliding window size; this model has {sorted(sizes)}")
    window = sizes.pop()
    if model_type in ("mistral", "phi3"):
        if not all(windows):
            raise ValueError(f"{model_type} windows every layer; this model has global layers too")
        return {"sliding_window": window}
    if model_type not in ("qwen2", "qwen3", "smollm3"):
        raise ValueError(f"{model_type} has no sliding window; this model has one of {window}")
    return {"use_sliding_window": True, "sliding_window": window,  # transformers' default starts at max_window_layers
            "max_window_layers": next(i for i, w in enumerate(windows) if w),
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windows]}


def _base_fits(base: dict[str, Any] | None, cfg: GPTConfig) -> bool:
    """``base`` (the config.json a model was imported from) describes a model with ``cfg``'s options."""
    if base is None or base.get("model_type") not in ARCHITECTURES:
        return False
    try:
        return _features(gpt_config_from_hf(base)) == _features(cfg)
    except ConfigError:
        return False


def _rope_fields(cfg: GPTConfig, model_type: str) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (v4) and ``rope_parameters`` (v5) for ``cfg``'s rotary embeddings."""
    scaling = dict(cfg.rope_scaling or {})
    if scaling.get("rope_type") == "dynamic":  # crosstrain's own record of the original context (max_position)
        scaling.pop("original_max_position_embeddings", None)
    params: dict[str, Any] = {"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_scaling": dict(params) if scaling else None,
                           "rope_parameters": params}
    if model_type == "phi3":
        params["partial_rotary_factor"] = cfg.rotary_fraction
        out["partial_rotary_factor"] = cfg.rotary_fraction
        if "original_max_position_embeddings" in scaling:  # Phi3Config reads it from the top level first
            out["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return out


def hf_config_from_gpt(
    cfg: GPTConfig, *, base: dict[str, Any] | None = None, dtype: str = "float32",
    bos_id: int | None = None, eos_id: int | None = None,
) -> dict[str, Any]:
    """A ``config.json`` for ``cfg``: the family that computes what it does (:func:`_model_type`: Llama unless an
    option needs another; Gemma's own mapping, :mod:`~crosstrain.models.hf.gemma`, for its sandwich norms), or
    ``base``'s model_type, whose other fields are kept, when ``base`` is the config the model was imported from and
    describes the same options."""
    if cfg.sandwich_norm:
        from crosstrain.models.hf.gemma import hf_config_from_gemma

        return hf_config_from_gemma(cfg, base=base, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
    model_type = _model_type(cfg)
    out: dict[str, Any] = {}
    max_position = cfg.max_seq_len
    if base is not None and _base_fits(base, cfg):
        model_type = str(base["model_type"])
        out.update({k: v for k, v in base.items() if not k.startswith("_")})
        if (cfg.rope_scaling or {}).get("rope_type") == "longrope":  # import capped max_seq_len at the original
            max_position = max(max_position, int(base.get("max_position_embeddings") or 0))  # context: keep its own
    else:
        out.update({"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None})
    out.update({
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, **_rope_fields(cfg, model_type),
        "attention_bias": cfg.out_bias, "mlp_bias": cfg.mlp_bias, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,  # transformers >= 4.56 reads "dtype", older versions "torch_dtype"
    })
    if model_type in ("qwen2", "qwen3", "smollm3"):
        out.update({"use_sliding_window": False, "sliding_window": None})
    if model_type == "qwen2":
        out.pop("attention_bias")
    elif model_type in ("mistral", "phi3"):
        out["sliding_window"] = None
    if model_type == "smollm3":
        out["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)]
        out.pop("layer_types", None)  # rebuilt by SmolLM3Config from no_rope_layers and use_sliding_window
    if model_type == "qwen3":
        out.pop("layer_types", None)  # rebuilt by Qwen3Config from use_sliding_window
    out.update(_window_fields(cfg, model_type))
    return out
