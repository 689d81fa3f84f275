"""Batched generation with a preallocated KV cache, for any backend and for sharded models (FSDP2, TP, DDP),
and continuous batching (:class:`ContinuousBatch`: sequences join and leave a running batch between steps).

``generate(model, prompts, GenerationConfig(...), generator)`` works on any model implementing the cache protocol
described in :mod:`crosstrain.generation.engine` (crosstrain's GPT does). docs/generation.md has the details.
"""

from crosstrain.generation.cache import StaticKVCache, cached_attention_mask
from crosstrain.generation.config import GenerationConfig, GenerationOutput
from crosstrain.generation.continuous import ContinuousBatch, Sequence
from crosstrain.generation.engine import generate, left_pad
from crosstrain.generation.sampling import filter_logits, next_tokens, token_logprobs
from crosstrain.generation.sharded import gathered
from crosstrain.generation.slots import SlotKVCache

__all__ = ["ContinuousBatch", "GenerationConfig", "GenerationOutput", "Sequence", "SlotKVCache", "StaticKVCache",
           "cached_attention_mask", "filter_logits", "gathered", "generate", "left_pad", "next_tokens",
           "token_logprobs"]
