"""State-dict adapters: crosstrain GPT parameter names <-> Hugging Face names, one per model family.

In the spirit of torchtitan's ``state_dict_adapter.py``: a pure name mapping, applied tensor by tensor so import
and export stream. No tensor is permuted: torchtitan permutes q/k rows because its rotary multiplies complex
pairs of *interleaved* channels, while crosstrain's rotary (``kernels.reference.rotary_embedding``) rotates the
two *halves* of each head, exactly like transformers' ``rotate_half`` in ``modeling_llama.py``. The weights
therefore mean the same thing in both layouts; tests/test_hf_models.py checks logits against transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from crosstrain.models.gpt import GPTConfig

#: per-block names: crosstrain suffix -> HF suffix (``layers.{i}.`` / ``model.layers.{i}.`` prefixes).
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CT_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: HF keys that are not parameters (rotary tables some older checkpoints saved); skipped on import.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class StateDictAdapter:
    """Maps names of one family; ``from_hf`` returns None for keys that carry no weights.

    A plugin's adapter (one a :class:`~crosstrain.models.family.FamilyExtension` registers, e.g. the MoE plugin's
    Mixtral) overrides the methods below them: the GPT config of a ``config.json``, the modules it puts into the
    GPT before the weights are copied, and tensors that are not one-to-one (per-expert HF tensors that are slices
    of one stacked parameter). Import and export stay streaming: one HF tensor at a time in, one GPT tensor out.
    """

    family: str

    def gpt_config(self, hf: dict[str, Any], where: str) -> GPTConfig:
        """The GPT's shape from a ``config.json`` of this model_type."""
        from crosstrain.models.hf.config import gpt_config_from_hf

        return gpt_config_from_hf(hf, where)

    def prepare(self, model: nn.Module, hf: dict[str, Any]) -> None:
        """Change the freshly built GPT in place before the weights are copied (a plugin's modules); none here."""

    def import_tensor(self, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, Any, torch.Tensor]]:
        """Where an HF tensor goes: ``(GPT name, index into that tensor or None for all of it, value)`` entries."""
        name = self.from_hf(hf_name)
        return [] if name is None else [(name, None, tensor)]

    def export_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of one GPT tensor (none for state the HF model does not have)."""
        return {self.to_hf(name): tensor}

    def hf_config(self, cfg: GPTConfig, *, base: dict[str, Any] | None, dtype: str, eos_id: int | None,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """The ``config.json`` to export ``cfg`` with (``shapes``: the exported tensors by GPT name)."""
        from crosstrain.models.hf.config import hf_config_from_gpt

        return hf_config_from_gpt(cfg, base=base, dtype=dtype, eos_id=eos_id)

    def to_hf(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        m = _CT_BLOCK.match(name)
        if m and m.group(2) in _BLOCK:
            return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
        raise KeyError(f"{name!r} has no {self.family} equivalent")

    def from_hf(self, name: str) -> str | None:
        if _HF_IGNORED.search(name):
            return None
        for ours, theirs in _TOP.items():
            if name == theirs:
                return ours
        m = _HF_BLOCK.match(name)
        if m:
            for ours, theirs in _BLOCK.items():
                if m.group(2) == theirs:
                    return f"layers.{m.group(1)}.{ours}"
        raise KeyError(f"{name!r} is not a {self.family} weight crosstrain knows")


#: Llama, Mistral and Qwen2 share transformers' Llama module names (Qwen2 adds the q/k/v biases listed above).
ADAPTERS: dict[str, StateDictAdapter] = {name: StateDictAdapter(name) for name in ("llama", "mistral", "qwen2")}


def find_adapter(model_type: str | None) -> StateDictAdapter | None:
    """The adapter a family or extension registered for ``model_type``, or None."""
    from crosstrain.errors import ConfigError
    from crosstrain.models.family import hf_adapter

    try:
        return hf_adapter(str(model_type))
    except ConfigError:
        return None


def adapter_for(model_type: str) -> StateDictAdapter:
    """The adapter of ``model_type`` from the family that registered it (:func:`crosstrain.models.family.hf_adapter`:
    these three are the ``gpt`` family's; a plugin's family brings its own)."""
    from crosstrain.models.family import hf_adapter

    return hf_adapter(model_type)
