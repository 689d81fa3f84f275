"""The static KV cache: one ``[B, kv_heads, max_len, head_dim]`` key and value buffer per layer, written in place.

Decoding appends one slot per step by slice assignment into buffers allocated once, so a step costs the same
however long the sequence already is (the concatenating cache of ``GPT.forward_with_cache`` copies the whole
past every step). Attention reads only the filled prefix ``[:length]``, or, after :meth:`StaticKVCache.make_static`
(the compiled decode step), the whole buffer under a mask, so every step has the same shapes.
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
        self._length = 0
        self.slot: torch.Tensor | None = None  # static mode: the fill position as a [1] long tensor
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        """Slots filled (in static mode read from the device: a host sync)."""
        return self._length if self.slot is None else int(self.slot)

    def make_static(self) -> None:
        """Static-shape mode, for a decode step compiled once (as HF ``StaticCache`` and gpt-fast do): the fill
        position lives in a device tensor advanced in place, :meth:`write` returns the whole buffers, and
        :meth:`attention_mask` masks the unfilled slots; no Python int changes between steps. Call after the
        prefill has allocated the buffers."""
        device = next(t.device for t in self.keys if t is not None)
        self.slot = torch.tensor([self._length], dtype=torch.long, device=device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, H, L, D]`` at slots ``[length, length + L)``; return the filled ``[B, H, length+L, D]``
        views (no copy), or the whole ``[B, H, max_len, D]`` buffers in static mode. :meth:`advance` moves
        ``length`` once every layer has written."""
        keys, values = self.keys[layer], self.values[layer]
        if self.slot is not None and keys is not None and values is not None:
            index = self.slot + torch.arange(k.shape[2], device=self.slot.device)
            keys.index_copy_(2, index, k.to(keys.dtype))
            values.index_copy_(2, index, v.to(values.dtype))
            return keys, values
        end = self._length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots needed, {self.max_len} allocated")
        if keys is None or values is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            dtype, device = self.dtype or k.dtype, self.device or k.device
            keys = torch.zeros(shape, dtype=dtype, device=device)
            values = torch.zeros(shape, dtype=dtype, device=device)
            self.keys[layer], self.values[layer] = keys, values
        keys[:, :, self._length:end] = k
        values[:, :, self._length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, n: int) -> None:
        if self.slot is None:
            self._length += n
        else:
            self.slot.add_(n)

    def attention_mask(self, key_mask: torch.Tensor | None, length: int, window: int = 0) -> torch.Tensor | None:
        """The sdpa mask for ``length`` new queries over what :meth:`write` returns: :func:`cached_attention_mask`,
        or in static mode over all ``max_len`` slots (``key_mask [B, max_len]`` or ``None``), where slots not
        yet written are masked like future ones. ``window`` > 0: a query sees only the last ``window`` slots."""
        if self.slot is None:
            return cached_attention_mask(key_mask, self._length, length, window)
        rows = (self.slot + torch.arange(length, device=self.slot.device)).unsqueeze(1)
        cols = torch.arange(self.max_len, device=self.slot.device).unsqueeze(0)
        visible = cols <= rows  # [L, max_len]: the past and itself, never the unwritten tail
        if window > 0:
            visible = visible & (rows - cols < window)
        if key_mask is None:
            return visible
        return (key_mask[:, None, None, :] & visible) | (cols == rows)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


def cached_attention_mask(key_mask: torch.Tensor | None, start: int, length: int,
                          window: int = 0) -> torch.Tensor | None:
    """The boolean sdpa mask ``[B, 1, L, start+L]`` (or ``[L, start+L]``) for ``L`` new queries at slots
    ``[start, start+L)``; ``None`` when no mask is needed. ``window`` > 0 hides keys ``window`` or more slots back
    (a sliding window counts cache slots, as transformers' masks count cache positions).

    A query sees a key when the key is a real token (``key_mask [B, start+L]``; ``None``: every slot is real) and
    not in its future. Every query also sees itself, so a left-padding query never has an all-masked row (sdpa
    would return NaN there, and the NaN would reach real rows through the pad slots' keys and values in the next
    layer, as 0 * NaN). One new token over real keys needs no mask at all: the past is never its future.
    """
    if length == 1 and (window <= 0 or start < window):
        return None if key_mask is None else key_mask[:, None, None, :]
    device = key_mask.device if key_mask is not None else None
    rows = torch.arange(start, start + length, device=device).unsqueeze(1)
    cols = torch.arange(start + length, device=device).unsqueeze(0)
    causal = cols <= rows
    if window > 0:
        causal = causal & (rows - cols < window)
    if key_mask is None:
        return causal
    return (key_mask[:, None, None, :] & causal) | (cols == rows)
