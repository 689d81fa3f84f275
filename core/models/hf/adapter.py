"""State-dict adapters: crosstrain GPT parameter names <-> Hugging Face names, one per model family.

In the spirit of torchtitan's ``state_dict_adapter.py``: a pure name mapping, applied tensor by tensor so import
and export stream. No tensor is permuted: torchtitan permutes q/k rows because its rotary multiplies complex
pairs of *interleaved* channels, while crosstrain's rotary (``kernels.reference.rotary_embedding``) rotates the
two *halves* of each head, exactly like transformers' ``rotate_half`` in ``modeling_llama.py``. The weights
therefore mean the same thing in both layouts; tests/test_hf_models.py checks logits against transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
#: Gemma 2/3: ``post_attention_layernorm`` is the norm *after* attention; the MLP has a pre and a post norm.
_GEMMA_BLOCK = {
    **{k: v for k, v in _BLOCK.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
}
_CT_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: HF keys that are not parameters (rotary tables some older checkpoints saved); skipped on import.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class StateDictAdapter:
    """Maps names of one family (per-block names ``block``: crosstrain suffix -> HF suffix); ``from_hf`` returns
    None for keys that carry no weights."""

    family: str
    block: dict[str, str] = field(default_factory=lambda: _BLOCK, compare=False, hash=False)

    def to_hf(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        m = _CT_BLOCK.match(name)
        if m and m.group(2) in self.block:
            return f"model.layers.{m.group(1)}.{self.block[m.group(2)]}"
        raise KeyError(f"{name!r} has no {self.family} equivalent")

    def from_hf(self, name: str) -> str | None:
        if _HF_IGNORED.search(name):
            return None
        for ours, theirs in _TOP.items():
            if name == theirs:
                return ours
        m = _HF_BLOCK.match(name)
        if m:
            for ours, theirs in self.block.items():
                if m.group(2) == theirs:
                    return f"layers.{m.group(1)}.{ours}"
        raise KeyError(f"{name!r} is not a {self.family} weight crosstrain knows")


#: Llama, Mistral and Qwen2 share transformers' Llama module names (Qwen2 adds the q/k/v biases listed above);
#: Gemma 2/3 name their sandwich norms their own way.
ADAPTERS: dict[str, StateDictAdapter] = {
    **{name: StateDictAdapter(name) for name in ("llama", "mistral", "qwen2")},
    **{name: StateDictAdapter(name, _GEMMA_BLOCK) for name in ("gemma2", "gemma3_text")},
}


def adapter_for(model_type: str) -> StateDictAdapter:
    """The adapter of ``model_type`` from the family that registered it (:func:`crosstrain.models.family.hf_adapter`:
    these three are the ``gpt`` family's; a plugin's family brings its own)."""
    from crosstrain.models.family import hf_adapter

    return hf_adapter(model_type)
