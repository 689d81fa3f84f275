"""Causal attention under sliding windows and packed documents, without a ``[B, 1, T, T]`` boolean mask.

A query at position ``i`` sees key ``j`` when ``j <= i``, ``i - j < window`` (the query itself included:
transformers' ``sliding_window_overlay``, ``kv_idx > q_idx - sliding_window``, as in Mistral, Qwen2 and Gemma)
and, with packed documents, both are in the same document (:mod:`crosstrain.models.document_mask`).

Two ways to compute it, chosen by what the device can do (:func:`attention_backend`), never by size:

* **flex** — ``torch.nn.attention.flex_attention`` with a ``create_block_mask`` block mask (FlexAttention,
  Dong et al. 2024): fully masked 128 x 128 blocks are skipped, nothing ``T x T`` exists. Used on CUDA. On CPU
  torch 2.13 compiles its forward (about 25 s per shape on this project's 2-core CI) but raises
  ``NotImplementedError`` for its backward, so CPU training cannot use it.
* **chunked** — queries in chunks of ``chunk`` rows, each attending (SDPA) only to the keys it can see: the
  ``chunk x (chunk + window - 1)`` band around the diagonal, or from the earliest document start in the chunk.
  Masks are built once per forward and shared by every layer; the backward recomputes each chunk instead of
  saving its scores, so peak attention memory grows with ``T x window`` instead of ``T^2``
  (``benchmarks/attention_masks.py``). Used everywhere else.

Plain causal attention (no window shorter than the sequence, no documents, no soft-capping) is not routed here:
the model keeps ``scaled_dot_product_attention(is_causal=True)``, so its numerics do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, cast

import torch
import torch.nn.functional as F

#: query rows per chunk of the chunked path. CPU SDPA pays per call: at T = 4096 with a 512 window, 128-row
#: chunks ran 2-3x slower than 256- or 512-row ones, and 512-row ones held more transient memory (peak ratio to
#: the dense mask 0.26 vs 0.23 for 256: benchmarks/attention_masks.py); masks stay ``chunk x (chunk + window - 1)``.
CHUNK = 256


def attention_backend(device: torch.device) -> str:
    """``"flex"`` where FlexAttention trains (CUDA: fused forward and backward kernels), else ``"chunked"``."""
    if device.type == "cuda":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:  # pragma: no cover - torch without FlexAttention
            return "chunked"
        return "flex"
    return "chunked"


@dataclass
class AttentionMask:
    """Who sees whom in one forward of ``seq_len`` tokens: causal, within ``window`` keys (0: unbounded), inside
    the same document when ``segments [B, T]`` (:func:`~crosstrain.models.document_mask.segment_index`) is given.

    Built once per forward and window, shared by every layer with that window; the chunked masks and the flex
    block mask are made on first use and cached here.
    """

    seq_len: int
    window: int = 0
    segments: torch.Tensor | None = None
    chunk: int = CHUNK
    backend: str | None = None  # None: attention_backend(q.device)
    _chunks: list[tuple[int, int, int, torch.Tensor]] | None = field(default=None, repr=False)
    _block_mask: Any = field(default=None, repr=False)

    @property
    def plain_causal(self) -> bool:
        """True when this is ordinary causal attention (SDPA ``is_causal`` computes it)."""
        return self.segments is None and (self.window <= 0 or self.window >= self.seq_len)

    def visible(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The mask rule on broadcastable ``[L, 1]`` / ``[1, S]`` positions: ``[L, S]``, or ``[B, L, S]`` with
        documents."""
        ok = kv_idx <= q_idx
        if self.window > 0:
            ok = ok & (q_idx - kv_idx < self.window)
        if self.segments is not None:
            ok = ok & (self.segments[:, q_idx] == self.segments[:, kv_idx])
        return ok

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """The ``[B or 1, 1, T, T]`` boolean mask this describes: the reference the tests and benchmark compare to."""
        device = device or (self.segments.device if self.segments is not None else None)
        idx = torch.arange(self.seq_len, device=device)
        mask = self.visible(idx[:, None], idx[None, :])
        return (mask if mask.dim() == 3 else mask.unsqueeze(0)).unsqueeze(1)

    def chunks(self, device: torch.device) -> list[tuple[int, int, int, torch.Tensor]]:
        """``(q_start, q_end, k_start, mask [B or 1, 1, q_end - q_start, q_end - k_start])`` per query chunk."""
        if self._chunks is None:
            t, c = self.seq_len, self.chunk
            starts = list(range(0, t, c))
            k_starts = [max(0, s - self.window + 1) if self.window > 0 else 0 for s in starts]
            if self.segments is not None:  # no key before the earliest document start of a chunk's first query
                from crosstrain.models.document_mask import document_positions

                first = torch.arange(t, device=self.segments.device) - document_positions(self.segments)
                doc_start = first[:, starts].min(dim=0).values.tolist()  # one host sync per forward
                k_starts = [max(k, int(d)) for k, d in zip(k_starts, doc_start, strict=True)]
            out = []
            for s, ks in zip(starts, k_starts, strict=True):
                e = min(s + c, t)
                rows = torch.arange(s, e, device=device)[:, None]
                cols = torch.arange(ks, e, device=device)[None, :]
                mask = self.visible(rows, cols)
                out.append((s, e, ks, (mask if mask.dim() == 3 else mask.unsqueeze(0)).unsqueeze(1)))
            self._chunks = out
        return self._chunks

    def block_mask(self, device: torch.device) -> Any:
        """The FlexAttention ``BlockMask`` (made once per forward and reused by every layer)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            segments = self.segments

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
                ok = kv_idx <= q_idx
                if self.window > 0:
                    ok = ok & (q_idx - kv_idx < self.window)
                if segments is not None:
                    ok = ok & (segments[b, q_idx] == segments[b, kv_idx])
                return ok

            batch = None if segments is None else segments.shape[0]
            self._block_mask = create_block_mask(mask_mod, batch, None, self.seq_len, self.seq_len, device=device)
        return self._block_mask


def softcap_scores(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(scores / cap)``: Gemma 2's attention-logit soft-capping (Gemma Team 2024, sec. 2)."""
    return torch.tanh(scores / cap) * cap


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                     scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention of ``q [B, H, L, D]`` over ``k, v [B, H or fewer, S, D]`` under a boolean ``mask`` (True:
    visible; None: all). SDPA unless ``softcap`` is set: SDPA cannot cap scores, so the scores are then materialised (as
    transformers' eager Gemma attention does: scale, cap, mask, softmax in fp32)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = softcap_scores(torch.matmul(q, k.transpose(-2, -1)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@lru_cache(maxsize=1)
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *,
                   scale: float | None = None, softcap: float = 0.0, compiled: bool = True) -> torch.Tensor:
    """FlexAttention with ``mask``'s block mask and, when ``softcap``, a tanh ``score_mod``."""
    from torch.nn.attention import flex_attention as fa

    score_mod = None
    if softcap:
        def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                      kv_idx: torch.Tensor) -> torch.Tensor:
            return softcap_scores(score, softcap)

    fn: Any = _compiled_flex() if compiled else fa.flex_attention
    out = fn(q, k, v, score_mod=score_mod, block_mask=mask.block_mask(q.device), scale=scale,
             enable_gqa=k.shape[1] != q.shape[1])
    return cast(torch.Tensor, out)


def _chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float | None,
                     softcap: float) -> torch.Tensor:
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    for s, e, ks, m in mask.chunks(q.device):
        out[:, :, s:e] = masked_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], m, scale=scale,
                                          softcap=softcap)
    return out


class _ChunkedAttention(torch.autograd.Function):
    """Chunked attention that saves only its inputs: the backward recomputes each chunk's attention and adds its
    gradients into whole ``dq, dk, dv`` buffers (FlashAttention's recomputation, Dao et al. 2022, at chunk
    granularity), so neither per-chunk scores nor full-size gradient copies per chunk are held."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                scale: float | None, softcap: float) -> torch.Tensor:
        ctx.mask, ctx.scale, ctx.softcap = mask, scale, softcap
        device = q.device.type  # the backward recomputes under the forward's autocast state
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(q, k, v)
        return _chunked_forward(q, k, v, mask, scale, softcap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        device, dtype, enabled = ctx.autocast
        for s, e, ks, m in ctx.mask.chunks(q.device):
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                qc, kc, vc = (t.detach().requires_grad_() for t in (q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e]))
                out = masked_attention(qc, kc, vc, m, scale=ctx.scale, softcap=ctx.softcap)
                gq, gk, gv = torch.autograd.grad(out, (qc, kc, vc), grad[:, :, s:e])
            dq[:, :, s:e] = gq
            dk[:, :, ks:e] += gk
            dv[:, :, ks:e] += gv
        return dq, dk, dv, None, None, None


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, *,
                      scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Each chunk of queries attends only to the keys :meth:`AttentionMask.chunks` gives it (``k, v`` may have
    fewer heads: grouped-query attention)."""
    mask.chunks(q.device)  # built (once per forward) outside the autograd.Function, which torch.compile traces
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        return _chunked_forward(q, k, v, mask, scale, softcap)
    return cast(torch.Tensor, _ChunkedAttention.apply(q, k, v, mask, scale, softcap))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None, *,
              scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal self-attention ``[B, H, T, D]`` (``k, v`` with ``H`` or fewer heads) under ``mask`` (None: causal).

    Ordinary causal attention goes to SDPA ``is_causal``; a window, documents or soft-capping go to the backend
    of :func:`attention_backend` (or ``mask.backend``)."""
    plain = mask is None or mask.plain_causal
    if plain and not softcap:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    mask = mask if mask is not None else AttentionMask(q.shape[2])
    if (mask.backend or attention_backend(q.device)) == "flex":
        return flex_attention(q, k, v, mask, scale=scale, softcap=softcap)
    return chunked_attention(q, k, v, mask, scale=scale, softcap=softcap)
