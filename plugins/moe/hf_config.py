"""Mixtral and Qwen3-MoE ``config.json`` <-> the GPT backbone (:class:`~crosstrain.models.gpt.GPTConfig`) and the
``[moe]`` section that turns it into the same model.

Field meanings: transformers 5.24 ``MixtralConfig`` (``num_local_experts``, ``num_experts_per_tok``,
``router_aux_loss_coef``, ``router_jitter_noise``; every block is sparse, experts of ``intermediate_size``) and
``Qwen3MoeConfig`` (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers``; dense blocks keep ``intermediate_size``). The attention is Mistral's (Mixtral) or Qwen3's
(Qwen3-MoE), read by the GPT family's own reader, so whatever it refuses (e.g. a rope type it lacks) is refused here
with the same one-line error. Sliding windows: Mixtral's on every layer (as Mistral's), Qwen3-MoE's on every layer
when ``use_sliding_window`` (transformers' Qwen3-MoE reads no ``layer_types``).
"""

from __future__ import annotations

from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPTConfig

#: model_type -> (the dense family whose attention it shares, the architecture transformers builds)
MOE_TYPES: dict[str, tuple[str, str]] = {
    "mixtral": ("mistral", "MixtralForCausalLM"),
    "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM"),
}

#: the ``[moe]`` keys a checkpoint fixes (its architecture); the others (aux-loss scope, z-loss, ...) are training
#: choices a run may set
ARCHITECTURE = ("experts", "top_k", "every", "dense_layers", "expert_dim", "shared_experts", "router", "renormalize")


def _int(hf: dict[str, Any], *keys: str, where: str) -> int:
    for key in keys:
        if hf.get(key) is not None:
            return int(hf[key])
    raise ConfigError(f"{where} has no {keys[0]!r}; it is not a complete {hf.get('model_type')} config")


def moe_fields(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The ``[moe]`` keys that make the GPT compute what transformers computes for this ``config.json``.

    Routers: Mixtral takes softmax over all experts, top-k and always renormalises (``MixtralTopKRouter``, also for
    top-1); Qwen3-MoE renormalises only with ``norm_topk_prob``. Experts are dropless, as in transformers (no
    token is ever dropped), and the router z-loss is off (neither model has one). The balance loss is transformers'
    (``aux_loss = "pooled"``, what ``output_router_logits = true`` adds) with ``router_aux_loss_coef``.
    """
    model_type = hf.get("model_type")
    if model_type not in MOE_TYPES:
        raise ConfigError(f"{where}: model_type={model_type!r} is not an MoE family crosstrain imports; "
                          f"supported: {', '.join(MOE_TYPES)}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; crosstrain's experts are "
                          "SwiGLU (silu)")
    out: dict[str, Any] = {"capacity_factor": 0.0, "z_loss_coeff": 0.0, "router": "softmax", "aux_loss": "pooled",
                           "aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)), "shared_experts": 0}
    out["top_k"] = _int(hf, "num_experts_per_tok", where=where)
    if model_type == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported "
                              "(transformers scales the experts' input too, crosstrain's moe.jitter the router's "
                              "only); set it to 0.0 in config.json")
        out.update(experts=_int(hf, "num_local_experts", "num_experts", where=where), every=1, dense_layers=[],
                   expert_dim=_int(hf, "intermediate_size", where=where), renormalize="always")
    else:
        out.update(experts=_int(hf, "num_experts", "num_local_experts", where=where),
                   every=int(hf.get("decoder_sparse_step") or 1),
                   dense_layers=sorted(int(i) for i in hf.get("mlp_only_layers") or ()),
                   expert_dim=_int(hf, "moe_intermediate_size", where=where),
                   renormalize="always" if hf.get("norm_topk_prob") else "never")
    if out["experts"] < 1:
        raise ConfigError(f"{where}: {out['experts']} experts; an MoE checkpoint needs at least one")
    return out


def gpt_config(hf: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """The GPT backbone (embeddings, attention, norms, dense MLPs) of a Mixtral / Qwen3-MoE ``config.json``:
    its attention family's reader applied to the same fields (Mixtral's attention is Mistral's)."""
    from crosstrain.models.hf.config import ARCHITECTURES, gpt_config_from_hf

    moe_fields(hf, where)  # refuse what the MoE layers cannot compute before anything else
    dense, _ = MOE_TYPES[str(hf["model_type"])]
    if dense not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type={hf['model_type']!r} needs {dense}'s attention, which this "
                          f"crosstrain's GPT does not implement yet; use a mixtral checkpoint")
    return gpt_config_from_hf(dense_config(hf), where)


def dense_config(hf: dict[str, Any]) -> dict[str, Any]:
    """An MoE ``config.json`` read as its dense family's: the same fields under the dense model_type, with
    Qwen3-MoE's windows on every layer (transformers' Qwen3-MoE reads no ``layer_types`` or ``max_window_layers``,
    unlike Qwen3)."""
    dense, _ = MOE_TYPES[str(hf["model_type"])]
    out = {**hf, "model_type": dense}
    if hf["model_type"] == "qwen3_moe" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        out["layer_types"] = ["sliding_attention"] * int(hf.get("num_hidden_layers") or 0)
    return out


def hf_config(cfg: GPTConfig, sec: Any, *, model_type: str, base: dict[str, Any] | None, dtype: str,
              eos_id: int | None) -> dict[str, Any]:
    """A ``config.json`` of ``model_type`` for the GPT ``cfg`` turned into MoE by ``sec`` (a ``MoESection``):
    the dense family's config with the MoE fields, the other fields of ``base`` (the imported one) kept."""
    from crosstrain.models.hf.config import hf_config_from_gpt

    dense, arch = MOE_TYPES[model_type]
    same = base is not None and base.get("model_type") == model_type
    out = hf_config_from_gpt(cfg, base=dense_config(base) if same and base else None, dtype=dtype,
                             eos_id=eos_id)
    out.update({"architectures": [arch], "model_type": model_type, "num_experts_per_tok": sec.top_k,
                "router_aux_loss_coef": sec.aux_loss_coeff, "output_router_logits": False})
    if model_type == "mixtral":
        out.update({"num_local_experts": sec.experts, "intermediate_size": sec.expert_dim, "router_jitter_noise": 0.0})
    else:
        out.update({"num_experts": sec.experts, "moe_intermediate_size": sec.expert_dim,
                    "decoder_sparse_step": sec.every, "mlp_only_layers": list(sec.dense_layers),
                    "norm_topk_prob": sec.renormalize == "always"})
    return out
