"""Hugging Face checkpoints in and out for the built-in GPT (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, SmolLM3,
with their sliding windows: :mod:`.config`; Gemma 2 and Gemma 3 text: :mod:`.gemma`).

Needs only safetensors and JSON; transformers is used by the tests to check parity, never by crosstrain.
"""

from crosstrain.models.hf.adapter import ADAPTERS, StateDictAdapter, adapter_for
from crosstrain.models.hf.config import ARCHITECTURES, gpt_config_from_hf, hf_config_from_gpt
from crosstrain.models.hf.pretrained import (
    is_hf_folder,
    load_hf_weights,
    load_pretrained,
    pretrained_config,
    read_hf_config,
)
from crosstrain.models.hf.weights import iter_tensors, parse_size, plan_shards, weight_files, write_weights

__all__ = [
    "ADAPTERS",
    "ARCHITECTURES",
    "StateDictAdapter",
    "adapter_for",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "is_hf_folder",
    "iter_tensors",
    "load_hf_weights",
    "load_pretrained",
    "parse_size",
    "plan_shards",
    "pretrained_config",
    "read_hf_config",
    "weight_files",
    "write_weights",
]
