"""A KV cache whose rows have their own lengths, for continuous batching (Yu et al. 2022, "Orca"; vLLM, TGI).

:class:`~crosstrain.generation.cache.StaticKVCache` fills the same slots in every row, so a batch starts and ends
together. Here each row holds one sequence at slots ``[0, lengths[row])`` and a decode step writes every row's new
key/value at that row's own ``lengths[row]``: a sequence prefilled alone joins a running batch at the next step
(:meth:`SlotKVCache.admit`) and leaves when it is done (:meth:`SlotKVCache.release`), without touching the other
rows. Rows ``[0, rows)`` are the live ones, kept packed so a step computes only them.

It implements what ``forward_cached`` asks of a cache (``write``, ``attention_mask``, ``advance``) for one new
token per row; the ``attention_mask`` argument of ``forward_cached`` is ignored (each row's keys are all real).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from crosstrain.generation.cache import StaticKVCache


class SlotKVCache:
    """Per-layer ``[slots, kv_heads, max_len, head_dim]`` key/value buffers; row ``r`` holds ``lengths[r]`` slots.

    The buffers are allocated by the first :meth:`admit`, in the dtype, device and head count of the prefilled
    cache, at full size: memory ``2 * n_layers * slots * max_len * kv_heads * head_dim * bytes``.
    """

    def __init__(self, n_layers: int, slots: int, max_len: int) -> None:
        self.slots = slots
        self.max_len = max_len
        self.rows = 0
        self.lengths: list[int] = [0] * slots
        self._lengths_t: torch.Tensor | None = None  # lengths on the buffers' device
        self._span = 0  # key slots this step reads: max live length + 1
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        """The longest live row (rows differ; ``forward_cached`` does not use this)."""
        return max(self.lengths[:self.rows], default=0)

    def admit(self, prefilled: StaticKVCache, row: int = 0) -> int:
        """Copy row ``row`` of a prefilled cache (its ``length`` slots) into the next free row; return that row."""
        if self.rows >= self.slots:
            raise ValueError(f"all {self.slots} rows of the slot cache are in use")
        n = prefilled.length
        if n > self.max_len:
            raise ValueError(f"a prefill of {n} slots does not fit a slot cache of {self.max_len}")
        target = self.rows
        for layer, (k, v) in enumerate(zip(prefilled.keys, prefilled.values, strict=True)):
            if k is None or v is None:
                raise ValueError("the prefilled cache has a layer never written; prefill it with forward_cached")
            if self.keys[layer] is None:
                shape = (self.slots, k.shape[1], self.max_len, k.shape[3])
                self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
                self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
            keys, values = self.keys[layer], self.values[layer]
            assert keys is not None and values is not None
            keys[target, :, :n] = k[row, :, :n]
            values[target, :, :n] = v[row, :, :n]
        self.lengths[target] = n
        self.rows += 1
        self._lengths_t = None
        return target

    def release(self, row: int) -> int | None:
        """Free ``row``: the last live row moves into it (one row copy) so the live rows stay packed. Returns the
        moved row's old index (its sequence now lives at ``row``), or None when ``row`` was the last."""
        last = self.rows - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} is not live (live rows: 0..{last})")
        self.rows -= 1
        self._lengths_t = None
        if row == last:
            return None
        n = self.lengths[last]
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is not None and values is not None:
                keys[row, :, :n] = keys[last, :, :n]
                values[row, :, :n] = values[last, :, :n]
        self.lengths[row] = n
        return last

    @contextmanager
    def undoing(self) -> Iterator[None]:
        """A decode step that raises inside leaves every row at its length before the step (the keys and values
        it wrote lie past those lengths, where the next step writes again); the exception propagates."""
        saved = list(self.lengths)
        try:
            yield
        except BaseException:
            self.lengths = saved
            self._lengths_t = None
            raise

    @contextmanager
    def alone(self, row: int) -> Iterator[SlotKVCache]:
        """A one-row cache over live ``row``'s buffers (views: what a step writes there lands in this cache), so one
        row can decode without the others; its new length is kept when the block exits without raising."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} is not live (live rows: 0..{self.rows - 1})")
        view = SlotKVCache(len(self.keys), 1, self.max_len)
        view.rows, view.lengths = 1, [self.lengths[row]]
        view.keys = [k[row:row + 1] if k is not None else None for k in self.keys]
        view.values = [v[row:row + 1] if v is not None else None for v in self.values]
        yield view
        self.lengths[row] = view.lengths[0]
        self._lengths_t = None

    def positions(self, device: torch.device) -> torch.Tensor:
        """``[rows, 1]``: each live row's next position (its length; prompts start at position 0)."""
        return self._device_lengths(device).unsqueeze(1)

    def _device_lengths(self, device: torch.device) -> torch.Tensor:
        if self._lengths_t is None or self._lengths_t.device != device:
            self._lengths_t = torch.tensor(self.lengths[:self.rows], dtype=torch.long, device=device)
        return self._lengths_t

    def attention_mask(self, key_mask: torch.Tensor | None, length: int, window: int = 0) -> torch.Tensor:
        """``[rows, 1, 1, span]``: row ``r``'s new token sees its ``lengths[r]`` past slots and itself, nothing
        beyond (other rows' longer pasts are stale or empty there); ``window`` > 0: only the last ``window`` of
        them (a sliding window counts slots, as :func:`~crosstrain.generation.cache.cached_attention_mask` does).
        ``key_mask`` is ignored: no row is padded."""
        if length != 1:
            raise ValueError("a slot cache decodes one token per row; prefill each sequence in a StaticKVCache")
        device = next(t.device for t in self.keys if t is not None)
        lengths = self._device_lengths(device)
        self._span = max(self.lengths[:self.rows]) + 1
        if self._span > self.max_len:
            raise ValueError(f"KV cache overflow: {self._span} slots needed, {self.max_len} allocated")
        cols = torch.arange(self._span, device=device).unsqueeze(0)
        visible = cols <= lengths.unsqueeze(1)
        if window > 0:
            visible = visible & (lengths.unsqueeze(1) - cols < window)
        return visible[:, None, None, :]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [rows, H, 1, D]`` at each row's own slot ``lengths[r]``; return the ``[rows, H, span, D]``
        views the step attends over (under :meth:`attention_mask`)."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "admit a prefilled sequence before decoding"
        rows = self.rows
        index = self._device_lengths(k.device).view(rows, 1, 1, 1).expand(rows, k.shape[1], 1, k.shape[3])
        keys[:rows].scatter_(2, index, k.to(keys.dtype))
        values[:rows].scatter_(2, index, v.to(values.dtype))
        return keys[:rows, :, :self._span], values[:rows, :, :self._span]

    def advance(self, n: int) -> None:
        for r in range(self.rows):
            self.lengths[r] += n
        self._lengths_t = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
