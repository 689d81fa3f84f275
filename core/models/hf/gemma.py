"""Gemma 2 and Gemma 3 text (``gemma2``, ``gemma3_text``) ``config.json`` <-> :class:`~crosstrain.models.gpt.GPTConfig`.

Gemma is the built-in GPT with (Gemma Team 2024, "Gemma 2", sec. 2; transformers' ``modeling_gemma2.py`` and
``modeling_gemma3.py``): embeddings times ``sqrt(hidden_size)``, RMSNorm scaling by ``1 + w``, a norm before *and*
after attention and the MLP ("sandwich"), GeGLU with tanh GELU, softmax scale ``query_pre_attn_scalar ** -0.5``,
alternating local (sliding window) and global layers (``layer_types``), tied embeddings; Gemma 2 soft-caps
attention and final logits (``cap * tanh(x / cap)``); Gemma 3 soft-caps the final logits only (transformers 5's
Gemma 3 stores ``attn_logit_softcapping`` and never applies it, so crosstrain does not read it), normalises q and k
per head, rotates its local layers with ``rope_local_base_freq`` and may scale its global layers' rope ``linear``ly.
Options the GPT does not compute are refused in one line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPTConfig
from crosstrain.models.hf.fields import DeclaredFields

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
#: transformers' default ``layer_types`` period: one global layer every N (Gemma 2: 2, Gemma 3: 6).
_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def _layer_types(cfg: Mapping[str, Any], model_type: str, n_layers: int) -> list[str]:
    """``layer_types``, or transformers' default: sliding unless ``(i + 1) % pattern == 0`` (Gemma 3's pattern from
    ``sliding_window_pattern``; Gemma2Config's is always 2)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = _PATTERN[model_type]
    if model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def _rope(cfg: Mapping[str, Any], model_type: str, where: str) -> tuple[float, float, dict[str, Any] | None]:
    """(global theta, local theta or 0, the global layers' scaling) from v5 ``rope_parameters`` (per layer type for
    Gemma 3, whose v4 ``rope_scaling`` applies to its global layers) or v4 fields. Gemma 3 4B+ scale their global
    layers ``linear``ly; any other scaling is refused."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if model_type == "gemma3_text":
        full = dict(params.get("full_attention") or {})
        full.update(scaling)
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        kinds = {"rope_parameters.full_attention.rope_type": (full.get("rope_type") or full.get("type"),
                                                               ("linear",)),
                 "rope_parameters.sliding_attention.rope_type": (local.get("rope_type"), ())}
    else:
        full, local = {"rope_theta": params.get("rope_theta") or cfg.get("rope_theta", 10_000.0)}, {}
        kinds = {"rope_parameters.rope_type": (params.get("rope_type"), ()),
                 "rope_scaling": (scaling.get("rope_type") or scaling.get("type"), ())}
    for field, (kind, allowed) in kinds.items():
        if kind not in (None, "default", *allowed):
            raise ConfigError(f"{where}: {field}={kind!r} is not supported for {model_type} (crosstrain computes "
                              f"{', '.join(('default', *allowed))} there); use a checkpoint without it")
    kind = full.get("rope_type") or full.get("type") or "default"
    global_scaling = None
    if kind == "linear":
        if full.get("factor") is None:
            raise ConfigError(f"{where}: rope_type='linear' needs rope_parameters.full_attention.factor; add it")
        global_scaling = {"rope_type": "linear", "factor": float(full["factor"])}
    return float(full["rope_theta"]), float(local.get("rope_theta", 0.0)), global_scaling


def gemma_config_from_hf(cfg: Mapping[str, Any], where: str = "config.json") -> GPTConfig:
    """The GPTConfig of a ``gemma2``/``gemma3_text`` ``config.json``; unsupported options are a one-line error.
    Gemma 3's ``attn_logit_softcapping`` is not read: transformers' Gemma 3 stores it and never applies it."""
    model_type = str(cfg["model_type"])
    cfg = DeclaredFields(cfg, model_type)
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation={act!r} is not supported; crosstrain's Gemma MLP is GeGLU "
                          "with tanh GELU (gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (crosstrain trains causal "
                          "language models); set it to false")
    bias = bool(cfg.get("attention_bias"))  # q/k/v and o_proj biases
    try:
        dim, heads, n_layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or dim // heads)
        theta, local_theta, scaling = _rope(cfg, model_type, where)
        window = int(cfg.get("sliding_window") or 0)
        types = _layer_types(cfg, model_type, n_layers)
        from crosstrain.models.hf.config import layer_windows

        windows = layer_windows({"layer_types": types}, window, n_layers, where)
        return GPTConfig(
            vocab_size=int(cfg["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), ffn_dim=int(cfg["intermediate_size"]),
            max_seq_len=int(cfg.get("max_position_embeddings", 8192)), rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attn_head_dim=head_dim if head_dim * heads != dim else 0, qkv_bias=bias, out_bias=bias,
            qk_norm="head" if model_type == "gemma3_text" else "",
            layer_windows=windows, rope_scaling=scaling,
            local_rope_theta=local_theta if local_theta != theta or scaling else 0.0,
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if model_type == "gemma2" else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
            embed_scale=True, norm_plus_one=True, sandwich_norm=True, mlp_act="gelu_tanh",
        )
    except KeyError as exc:
        raise ConfigError(f"{where} has no {exc.args[0]!r}; it is not a complete {model_type} config") from None


def gemma_model_type(cfg: GPTConfig) -> str:
    """``gemma3_text`` when the GPT has Gemma 3's q/k norms, else ``gemma2``."""
    return "gemma3_text" if cfg.qk_norm == "head" else "gemma2"


def hf_config_from_gemma(
    cfg: GPTConfig, *, base: dict[str, Any] | None = None, dtype: str = "float32",
    bos_id: int | None = None, eos_id: int | None = None,
) -> dict[str, Any]:
    """A Gemma ``config.json`` for ``cfg`` (``base``'s other fields kept when it is the imported config)."""
    model_type = gemma_model_type(cfg)
    if model_type == "gemma3_text" and cfg.attn_softcap:
        raise ValueError(f"attn_softcap={cfg.attn_softcap} has no Gemma 3 field: transformers' Gemma 3 stores "
                         "attn_logit_softcapping and never applies it")
    out: dict[str, Any] = {}
    if base is not None and base.get("model_type") == model_type:
        out.update({k: v for k, v in base.items() if not k.startswith("_")})
    else:
        out.update({"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None})
    windows = cfg.layer_windows or (cfg.sliding_window,) * cfg.n_layers
    window = max(windows)
    if len({w for w in windows if w}) > 1:
        raise ValueError(f"Gemma has one sliding window size; this model has {sorted(set(windows))}")
    scalar = cfg.attn_scale ** -2 if cfg.attn_scale else float(cfg.head_dim)
    scalar = int(round(scalar)) if abs(scalar - round(scalar)) < 1e-6 else scalar  # the config field is an int
    out.update({
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "query_pre_attn_scalar": out.get("query_pre_attn_scalar", scalar),
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windows],
        "final_logit_softcapping": cfg.final_softcap or None,
        "attention_bias": cfg.out_bias, "use_cache": True, "dtype": dtype, "torch_dtype": dtype,
    })
    if model_type == "gemma2":
        out["attn_logit_softcapping"] = cfg.attn_softcap or None
    else:  # inert in transformers' Gemma 3 (gemma_config_from_hf): an imported config keeps its own value
        out.setdefault("attn_logit_softcapping", None)
    if model_type == "gemma3_text":
        local = cfg.local_rope_theta or cfg.rope_theta
        out["rope_parameters"] = {"full_attention": {"rope_type": "default", **(cfg.rope_scaling or {}),
                                                     "rope_theta": cfg.rope_theta},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        out.pop("rope_theta", None)
        out.pop("rope_local_base_freq", None)
        out.pop("rope_scaling", None)
    else:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return out
