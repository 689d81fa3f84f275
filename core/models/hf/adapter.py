"""State-dict adapters: crosstrain GPT parameter names <-> Hugging Face names, one per model family.

In the spirit of torchtitan's ``state_dict_adapter.py``: a pure name mapping, applied tensor by tensor so import
and export stream. No tensor is permuted: torchtitan permutes q/k rows because its rotary multiplies complex
pairs of *interleaved* channels, while crosstrain's rotary (``kernels.reference.rotary_embedding``) rotates the
two *halves* of each head, exactly like transformers' ``rotate_half`` in ``modeling_llama.py``. The weights
therefore mean the same thing in both layouts; tests/test_hf_models.py checks logits against transformers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
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
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",
    "feed_forward.w3.bias": "mlp.up_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
}
#: OLMo 2 normalises each sublayer's output: crosstrain's attention_norm/ffn_norm sit after attention and MLP.
_OLMO2_BLOCK = {**_BLOCK, "attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "post_feedforward_layernorm.weight"}
#: Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (rows concatenated in this order).
_PHI3_FUSED = {
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
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
    """Maps names of one family; ``from_hf`` returns None for keys that carry no weights. ``fused`` HF tensors
    (Phi-3's ``qkv_proj``) hold several crosstrain tensors concatenated on dim 0: import splits them
    (:meth:`from_hf_tensor`), export concatenates them (:meth:`export_groups`, :meth:`to_hf_tensors`).

    A plugin's adapter (one a :class:`~crosstrain.models.family.FamilyExtension` registers, e.g. the MoE plugin's
    Mixtral) also overrides :meth:`gpt_config` (the GPT of a ``config.json``), :meth:`prepare` (the modules it puts
    into the GPT before the weights are copied), :meth:`import_tensor` (HF tensors that fill a slice of a GPT
    tensor: one expert of a stacked weight) and :meth:`hf_config`; import and export stay streaming."""

    family: str
    block: Mapping[str, str] = field(default_factory=lambda: _BLOCK, hash=False)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def _fused_of(self) -> dict[str, tuple[str, int]]:
        return {ours: (theirs, i) for theirs, members in self.fused.items() for i, ours in enumerate(members)}

    def gpt_config(self, hf: dict[str, Any], where: str) -> GPTConfig:
        """The GPT's shape from a ``config.json`` of this model_type."""
        from crosstrain.models.hf.config import gpt_config_from_hf

        return gpt_config_from_hf(hf, where)

    def prepare(self, model: nn.Module, hf: dict[str, Any]) -> None:
        """Change the freshly built GPT in place before the weights are copied (a plugin's modules); none here."""

    def import_tensor(self, name: str, tensor: torch.Tensor,
                      shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, Any, torch.Tensor]]:
        """``(crosstrain name, index into that tensor or None for all of it, value)`` for HF tensor ``name``:
        :meth:`from_hf_tensor`'s whole tensors here."""
        return [(n, None, t) for n, t in self.from_hf_tensor(name, tensor, shapes)]

    def hf_config(self, cfg: GPTConfig, *, base: dict[str, Any] | None, dtype: str, eos_id: int | None,
                  shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
        """The ``config.json`` to export ``cfg`` with (``shapes``: the exported tensors by crosstrain name)."""
        from crosstrain.models.hf.config import hf_config_from_gpt

        return hf_config_from_gpt(cfg, base=base, dtype=dtype, eos_id=eos_id)

    def to_hf(self, name: str) -> str:
        """The HF name of crosstrain tensor ``name`` (for a fused member: the fused tensor that holds it)."""
        if name in _TOP:
            return _TOP[name]
        m = _CT_BLOCK.match(name)
        if m:
            fused = self._fused_of().get(m.group(2))
            if fused is not None:
                return f"model.layers.{m.group(1)}.{fused[0]}"
            if m.group(2) in self.block:
                return f"model.layers.{m.group(1)}.{self.block[m.group(2)]}"
        raise KeyError(f"{name!r} has no {self.family} equivalent")

    def from_hf_all(self, name: str) -> list[str]:
        """The crosstrain names HF tensor ``name`` holds (several for a fused one, none for a skipped key)."""
        if _HF_IGNORED.search(name):
            return []
        for ours, theirs in _TOP.items():
            if name == theirs:
                return [ours]
        m = _HF_BLOCK.match(name)
        if m:
            if m.group(2) in self.fused:
                return [f"layers.{m.group(1)}.{ours}" for ours in self.fused[m.group(2)]]
            for ours, theirs in self.block.items():
                if m.group(2) == theirs and ours not in self._fused_of():
                    return [f"layers.{m.group(1)}.{ours}"]
        raise KeyError(f"{name!r} is not a {self.family} weight crosstrain knows")

    def from_hf(self, name: str) -> str | None:
        """The crosstrain name of a one-to-one HF tensor (None for skipped keys); see :meth:`from_hf_all`."""
        names = self.from_hf_all(name)
        if len(names) > 1:
            raise KeyError(f"{name!r} is a fused {self.family} tensor; split it with from_hf_tensor")
        return names[0] if names else None

    def from_hf_tensor(self, name: str, tensor: torch.Tensor,
                       shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
        """``(crosstrain name, tensor)`` pairs in HF tensor ``name``: a fused one split on dim 0 by the members'
        rows in ``shapes`` (the GPT's parameter shapes)."""
        names = self.from_hf_all(name)
        if len(names) <= 1:
            return [(n, tensor) for n in names]
        rows = [int(shapes[n][0]) if n in shapes else -1 for n in names]
        if min(rows) < 0 or sum(rows) != tensor.shape[0]:
            raise KeyError(f"{name!r} has {tensor.shape[0]} rows, not the {'+'.join(map(str, rows))} of "
                           f"{', '.join(names)}")
        return list(zip(names, tensor.split(rows, dim=0), strict=True))

    def export_groups(self, names: Sequence[str]) -> list[list[str]]:
        """``names`` (crosstrain, in order) grouped by the HF tensor each goes into, in order of first member."""
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(self.to_hf(name), []).append(name)
        fused = self._fused_of()
        for hf_name, members in groups.items():
            order = [fused.get(_CT_BLOCK.sub(r"\2", n), (hf_name, 0))[1] for n in members]
            groups[hf_name] = [n for _, n in sorted(zip(order, members, strict=True))]
        return list(groups.values())

    def to_hf_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors of whole export groups (fused members concatenated on dim 0 in the family's order)."""
        out: dict[str, list[torch.Tensor]] = {}
        for group in self.export_groups(list(tensors)):
            out[self.to_hf(group[0])] = [tensors[n] for n in group]
        return {k: v[0] if len(v) == 1 else torch.cat(v, dim=0) for k, v in out.items()}


#: Llama, Mistral, Qwen2, Qwen3 and SmolLM3 share transformers' Llama module names (with the biases and q/k norms
#: above where the family has them); OLMo 2 moves the norms after each sublayer; Phi-3 fuses q/k/v and gate/up;
#: Gemma 2/3 name their sandwich norms their own way.
ADAPTERS: dict[str, StateDictAdapter] = {
    **{name: StateDictAdapter(name) for name in ("llama", "mistral", "qwen2", "qwen3", "smollm3")},
    "olmo2": StateDictAdapter("olmo2", block=_OLMO2_BLOCK),
    "phi3": StateDictAdapter("phi3", fused=_PHI3_FUSED),
    **{name: StateDictAdapter(name, block=_GEMMA_BLOCK) for name in ("gemma2", "gemma3_text")},
}


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
    these are the ``gpt`` family's; a plugin's family brings its own)."""
    from crosstrain.models.family import hf_adapter

    return hf_adapter(model_type)
