"""The static KV cache: one ``[B, kv_heads, max_len, head_dim]`` key and value buffer per layer, written in place.

Decoding appends one slot per step by slice assignment into buffers allocated once, so a step costs the same
however long the sequence already is (the concatenating cache of ``GPT.forward_with_cache`` copies the whole
past every step). Attention reads only the filled prefix ``[:length]``.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Per-layer key/value buffers of ``max_len`` slots; ``length`` slots (the same for every row) are filled.

    Each layer's buffers are allocated on its first write (the prefill), at full length, in that write's dtype,
    device and local head count, so the cache follows what the model really computes: bf16 under FSDP2 mixed
    precision or autocast, ``kv_heads / tp`` heads under tensor parallelism. ``dtype``/``device`` override that.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        self.batch = batch
        self.max_len = max_len
        self.length = 0
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, H, L, D]`` at slots ``[length, length + L)``; return the filled ``[B, H, length+L, D]``
        views (no copy). :meth:`advance` moves ``length`` once every layer has written."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.max_len} allocated")
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            dtype, device = self.dtype or k.dtype, self.device or k.device
            keys = torch.zeros(shape, dtype=dtype, device=device)
            values = torch.zeros(shape, dtype=dtype, device=device)
            self.keys[layer], self.values[layer] = keys, values
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


def cached_attention_mask(key_mask: torch.Tensor | None, start: int, length: int) -> torch.Tensor | None:
    """The boolean sdpa mask ``[B, 1, L, start+L]`` (or ``[L, start+L]``) for ``L`` new queries at slots
    ``[start, start+L)``; ``None`` when no mask is needed.

    A query sees a key when the key is a real token (``key_mask [B, start+L]``; ``None``: every slot is real) and
    not in its future. Every query also sees itself, so a left-padding query never has an all-masked row (sdpa
    would return NaN there, and the NaN would reach real rows through the pad slots' keys and values in the next
    layer, as 0 * NaN). One new token over real keys needs no mask at all: the past is never its future.
    """
    if length == 1:
        return None if key_mask is None else key_mask[:, None, None, :]
    device = key_mask.device if key_mask is not None else None
    rows = torch.arange(start, start + length, device=device).unsqueeze(1)
    cols = torch.arange(start + length, device=device).unsqueeze(0)
    causal = cols <= rows
    if key_mask is None:
        return causal
    return (key_mask[:, None, None, :] & causal) | (cols == rows)
