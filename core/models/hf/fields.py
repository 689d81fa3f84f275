"""The ``config.json`` fields each native family's reader may read, declared per ``model_type``.

A reader (:func:`~crosstrain.models.hf.config.gpt_config_from_hf`,
:func:`~crosstrain.models.hf.gemma.gemma_config_from_hf`) sees the config through :class:`DeclaredFields`, so
reading an undeclared field fails at once: the tuples below are the whole of what crosstrain takes from a family's
config. tests/test_hf_semantics.py compares them with the fields transformers' modeling code for the family reads (a
field transformers ignores must not change crosstrain's model, e.g. Gemma 3's ``attn_logit_softcapping``; a field it
reads that changes the math must be read, or refused, here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

_SHAPE = ("model_type", "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
          "num_hidden_layers", "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps",
          "tie_word_embeddings")
#: the rotary fields of the Llama-shaped families: v5 ``rope_parameters``, v4 ``rope_theta``/``rope_scaling``,
#: ``partial_rotary_factor`` (refused unless Phi-3) and a top-level ``original_max_position_embeddings`` (llama3, yarn,
#: longrope), which their configs fold into ``rope_parameters`` (``standardize_rope_params``)
_ROPE = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
_LLAMA = (*_SHAPE, *_ROPE, "hidden_act")
#: Qwen's ``layer_types`` come from ``use_sliding_window`` and ``max_window_layers`` (Qwen2Config/Qwen3Config)
_QWEN_WINDOWS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
_GEMMA = (*_SHAPE, "rope_parameters", "rope_scaling", "rope_theta", "hidden_activation", "use_bidirectional_attention",
          "attention_bias", "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping")

#: model_type -> the config.json fields its reader reads
READS: dict[str, tuple[str, ...]] = {
    "llama": (*_LLAMA, "attention_bias", "mlp_bias"),
    "mistral": (*_LLAMA, "sliding_window"),
    "qwen2": (*_LLAMA, *_QWEN_WINDOWS),
    "qwen3": (*_LLAMA, "attention_bias", *_QWEN_WINDOWS),
    "phi3": (*_LLAMA, "sliding_window"),
    "olmo2": (*_LLAMA, "attention_bias"),
    "smollm3": (*_LLAMA, "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "layer_types",
                "no_rope_layers", "no_rope_layer_interval"),
    # Gemma 3's modeling code stores attn_logit_softcapping and never applies it (transformers 5): not read here
    "gemma2": (*_GEMMA, "attn_logit_softcapping"),
    "gemma3_text": (*_GEMMA, "rope_local_base_freq", "sliding_window_pattern"),  # Gemma3TextConfig's layer_types
}


class DeclaredFields(Mapping[str, Any]):
    """A read-only view of a ``config.json`` that allows reading only ``fields``; ``read`` records what was read."""

    def __init__(self, data: Mapping[str, Any], model_type: str) -> None:
        self._data, self._model_type, self._fields = data, model_type, frozenset(READS[model_type])
        self.read: set[str] = set()

    def _check(self, key: str) -> None:
        if key not in self._fields:  # a reader bug, not a user error: declare the field in READS first
            raise LookupError(f"the {self._model_type} reader reads config field {key!r}, which "
                              "crosstrain.models.hf.fields.READS does not declare for it")
        self.read.add(key)

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return self._data.get(key, default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._fields and key in self._data

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._data if k in self._fields)

    def __len__(self) -> int:
        return sum(1 for _ in self)

