"""Which transformers models the generic path trains: decoder-only causal LMs, told from ``config.json`` alone.

transformers gives an encoder (BERT, ELECTRA, RoBERTa) a causal-LM class too (``BertLMHeadModel``), but it attends
causally only with ``is_decoder = true`` (XLM: ``causal = true``); a plain encoder checkpoint would train as a causal
LM with bidirectional attention (each position sees the token it predicts). An encoder-decoder (T5, BART, Whisper)
has no decoder-only class for its whole checkpoint. Both are refused before anything is built.
"""

from __future__ import annotations

from typing import Any

_HINT = "the generic path trains decoder-only causal LMs (crosstrain models lists them)"
#: masked-LM types whose own config field switches their attention to causal: XLM's ``causal`` (modeling_xlm.py's
#: ``get_masks`` builds the triangular mask from it; XLM's CLM pre-training)
_CAUSAL_FIELD = {"xlm": "causal"}


def _names() -> tuple[set[str], set[str], set[str]]:
    """transformers' causal-LM model_types, its masked-LM (encoder) ones, and its sequence-to-sequence ones."""
    from transformers.models.auto import modeling_auto as auto

    seq2seq = {*auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, *auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES}
    return set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES), seq2seq


def decoder_only_types() -> set[str]:
    """The model_types that are decoder-only causal LMs as configured by default (encoders and encoder-decoders
    out, though transformers lists a causal-LM class for some of them)."""
    causal, masked, seq2seq = _names()
    return causal - masked - seq2seq


def refusal(hf_config: dict[str, Any], where: str) -> str | None:
    """Why ``hf_config`` (a config.json read from ``where``) is no decoder-only causal LM, or None when it is one
    (or its model_type is unknown to transformers, which building it reports)."""
    from transformers import CONFIG_MAPPING

    model_type = str(hf_config.get("model_type", ""))
    if model_type not in CONFIG_MAPPING:
        return None
    causal, masked, _ = _names()
    arch = ", ".join(hf_config.get("architectures") or []) or model_type
    if hf_config.get("is_encoder_decoder"):
        return f"{where} is an encoder-decoder model ({arch}, is_encoder_decoder=true); {_HINT}"
    if model_type not in causal:
        return f"{where} is model_type {model_type!r} ({arch}), which has no causal-LM class in transformers; {_HINT}"
    field = _CAUSAL_FIELD.get(model_type, "is_decoder")
    if model_type in masked and not hf_config.get("is_decoder") and not hf_config.get(field):
        return (f"{where} is an encoder ({arch}, {field}=false: bidirectional attention, no causal mask), which "
                f"would train as a causal LM that sees the tokens it predicts; {_HINT}")
    return None
