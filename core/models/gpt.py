"""The built-in decoder-only GPT: RMSNorm, rotary embeddings, SwiGLU, optional tied embeddings.

Plain PyTorch in the torchtitan style: blocks live in a ``ModuleDict`` keyed by index so pipeline stages
can drop the layers they do not own (and ``tok_embeddings``/``norm``/``output`` may be ``None`` on inner
stages); attention infers the local head count from the projection width, so tensor-parallel plans that
shard heads need no model change. Every hot op goes through the kernel registry.

The model owns its parallel plans (see :mod:`crosstrain.parallel.plan`): Megatron-style ``tp_plan()`` on
``Attention``, ``FeedForward`` and ``GPT`` (each names only its own children, so a plugin may swap the MLP for
a module with its own plan), ``GPT.pipeline_split`` and ``GPT.ac_units`` (the blocks).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain import kernels
from crosstrain.generation.cache import StaticKVCache
from crosstrain.models.attention_masks import AttentionMask, attention, masked_attention, softcap_scores
from crosstrain.models.fused_linear import hookless, project, residual_linear
from crosstrain.models.qk_norm import HeadNorm, ProjectionNorm, head_norm_style, projection_norm_style
from crosstrain.models.rope import rope_tables


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``ffn_dim`` 0 means ``8/3 * dim`` rounded up to a multiple of 32."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0
    ffn_dim: int = 0
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on wq/wk/wv (Qwen2); off keeps the default model's parameters and RNG draws
    # -- Hugging Face families (Llama 3 rope scaling, Qwen3, Phi-3, OLMo 2, SmolLM3; docs/models.md). Every default
    # is off: the default model's parameters, their creation order and its random draws are unchanged. --
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # HF rope_parameters (crosstrain.models.rope)
    rotary_fraction: float = 1.0  # partial_rotary_factor: rotate only the first int(head_dim * f) channels (Phi-3)
    attn_head_dim: int = 0  # explicit head_dim (Qwen3: head_dim * n_heads may differ from dim); 0 = dim // n_heads
    qk_norm: str = ""  # "head": RMSNorm of each q/k head (Qwen3); "proj": of the whole q/k projection (OLMo 2)
    out_bias: bool = False  # bias on wo (Llama's attention_bias sets it with qkv_bias)
    mlp_bias: bool = False  # biases on w1/w3/w2
    post_norm: bool = False  # OLMo 2: attention_norm/ffn_norm on each sublayer's output, before the residual add
    nope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (SmolLM3's no_rope_layers == 0)
    # -- sliding windows, soft-capping and Gemma's layout (crosstrain.models.attention_masks, models/hf/gemma.py);
    #    every default below leaves the Llama-style GPT above unchanged, parameters and numerics --
    sliding_window: int = 0  # keys a query sees, itself included (Mistral, Qwen2, Gemma); 0: unbounded
    layer_windows: tuple[int, ...] = ()  # one window per layer (0: global), overriding sliding_window (Gemma)
    local_rope_theta: float = 0.0  # rope base of windowed layers (Gemma 3's rope_local_base_freq); 0: rope_theta
    attn_scale: float = 0.0  # softmax scale (Gemma: query_pre_attn_scalar ** -0.5); 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # attention scores -> cap * tanh(scores / cap) (Gemma 2); 0: off
    final_softcap: float = 0.0  # the same on the output logits (Gemma 2); 0: off
    embed_scale: bool = False  # embeddings times sqrt(dim) (Gemma)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), w initialised to 0 (Gemma; its q/k norms too)
    sandwich_norm: bool = False  # norms after attention and after the MLP too, before each residual add (Gemma 2/3)
    mlp_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)

    def __post_init__(self) -> None:
        if not isinstance(self.nope_layers, tuple):  # JSON gives lists
            object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))  # JSON gives lists
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for n_layers={self.n_layers}")

    def window_of(self, layer: int) -> int:
        """The sliding window of block ``layer`` (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window
    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the rotary embedding turns (``int(head_dim * rotary_fraction)``, transformers')."""
        return self.head_dim if self.rotary_fraction == 1.0 else int(self.head_dim * self.rotary_fraction)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        return 32 * math.ceil(8 * self.dim / 3 / 32)

    def to_dict(self) -> dict:
        """The fields as JSON gives them back (``nope_layers``, ``layer_windows`` lists)."""
        out = asdict(self)
        out["nope_layers"] = list(self.nope_layers)
        out["layer_windows"] = list(self.layer_windows)
        return out


#: Presets from CPU-seconds to ~1B parameters (byte-level vocabulary unless overridden).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=256),
    "small": GPTConfig(dim=256, n_layers=4, n_heads=8, max_seq_len=512),
    "100m": GPTConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024, tie_embeddings=True),
    "350m": GPTConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, max_seq_len=2048),
    "1b": GPTConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, max_seq_len=2048),
}


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019); ``plus_one``: the scale is ``1 + weight`` with ``weight`` starting at 0,
    as Gemma stores it (transformers' ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight + 1.0 if self.plus_one else self.weight, self.eps)

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.plus_one else nn.init.ones_)(self.weight)

    def with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, self(x))`` for an ``x`` that also feeds a residual add: the two gradients of ``x`` are summed in
        the norm's backward kernel where it offers that (:func:`crosstrain.kernels.rms_norm_residual`)."""
        if self.plus_one or not hookless(self):
            return x, self(x)
        return kernels.rms_norm_residual(x, self.weight, self.eps)


KVCache = tuple[torch.Tensor, torch.Tensor]


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary kernel on ``x [B, T, H, D]`` with shared ``[T, R/2]`` tables, or per-row ``[B, T, R/2]`` ones
    (packed documents): those are applied on ``[B*T, H, D]`` so every kernel sees its documented 2-D tables.
    Tables narrower than the head (``R < D``, partial rotary) turn the first ``R`` channels and pass the rest, as
    transformers' Phi-3 ``apply_rotary_pos_emb`` does."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((_rotary(x[..., :rotary].contiguous(), cos, sin), x[..., rotary:]), dim=-1)
    if cos.dim() == 2:
        return kernels.rotary_embedding(x, cos, sin)
    b, t, h, d = x.shape
    flat = kernels.rotary_embedding(x.reshape(b * t, h, d), cos.reshape(b * t, -1), sin.reshape(b * t, -1))
    return flat.view(b, t, h, d)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, rotary: bool = True) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rotary = rotary  # False: a NoPE layer (SmolLM3)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        self.scale = cfg.attn_scale or None  # None: SDPA's own 1/sqrt(head_dim)
        self.softcap = cfg.attn_softcap
        self.q_norm: HeadNorm | ProjectionNorm | None = None
        self.k_norm: HeadNorm | ProjectionNorm | None = None
        if cfg.qk_norm == "head":
            self.q_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_plus_one)
            self.k_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_plus_one)
        elif cfg.qk_norm == "proj":
            self.q_norm = ProjectionNorm(cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = ProjectionNorm(cfg.kv_heads * cfg.head_dim, cfg.norm_eps)
        elif cfg.qk_norm:
            raise ValueError(f"qk_norm={cfg.qk_norm!r}; use 'head', 'proj' or ''")

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v ``[B, T, H, D]``: projections, q/k norms (whole projection for OLMo 2, per head for Qwen3) and
        rotary embeddings, in transformers' order."""
        bsz, seqlen, _ = x.shape
        q, k, v = project(x, (self.wq, self.wk, self.wv))
        if isinstance(self.q_norm, ProjectionNorm):
            q, k = self.q_norm(q), cast(ProjectionNorm, self.k_norm)(k)
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if isinstance(self.q_norm, HeadNorm):
            q, k = self.q_norm(q), cast(HeadNorm, self.k_norm)(k)
        if self.rotary:
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        return q, k, v
    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KVCache | None = None,
        mask: AttentionMask | None = None, residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """``mask`` (None: causal) says who sees whom: a sliding window, packed documents; see
        :mod:`crosstrain.models.attention_masks`. With ``residual`` the output is ``residual + attention``, the
        addition done by ``wo``'s GEMM (:func:`crosstrain.models.fused_linear.residual_linear`)."""
        bsz, seqlen, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        present = (k, v)
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if past is not None:
            past_len = k.shape[2] - seqlen
            rows = torch.arange(seqlen, device=x.device).unsqueeze(1) + past_len
            cols = torch.arange(k.shape[2], device=x.device).unsqueeze(0)
            visible = cols <= rows
            if mask is not None and mask.window > 0:
                visible = visible & (rows - cols < mask.window)
            out = masked_attention(q, k, v, visible, scale=self.scale, softcap=self.softcap)
        elif mask is None and self.scale is None and not self.softcap:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the default model, bit for bit
        else:  # a window, packed documents or Gemma's scale/soft-capping
            out = attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return (self.wo(out) if residual is None else residual_linear(residual, out, self.wo)), present

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                       layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention for new tokens ``x [B, L, dim]`` with per-row rotary tables ``[B, L, head_dim/2]``: their
        keys/values are written into ``cache`` in place, and sdpa reads only the filled slots under ``mask``."""
        bsz, seqlen, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, cos, sin))
        keys, values = cache.write(layer, k, v)
        out = masked_attention(q, keys, values, mask, scale=self.scale, softcap=self.softcap)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def tp_plan(self) -> dict[str, Any]:
        """q/k/v column-parallel (each tp rank owns ``n_heads / tp`` heads), ``wo`` row-parallel (all-reduced)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
        if self.q_norm is not None:  # each rank's heads: the norm's weight sharded (OLMo 2) or replicated (Qwen3)
            style = projection_norm_style if isinstance(self.q_norm, ProjectionNorm) else head_norm_style
            plan.update({"q_norm": style(), "k_norm": style()})
        return plan


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.mlp_bias)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.mlp_bias)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.mlp_bias)  # down
        self.act = cfg.mlp_act

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The gated MLP; with ``residual``, ``residual + mlp(x)`` with the addition done by ``w2``'s GEMM."""
        gate, up = project(x, (self.w1, self.w3))
        if self.act == "gelu_tanh":  # GeGLU (Shazeer 2020) with tanh-approximated GELU, as Gemma's MLP
            hidden = F.gelu(gate, approximate="tanh") * up
        else:
            hidden = kernels.swiglu(gate, up)
        return self.w2(hidden) if residual is None else residual_linear(residual, hidden, self.w2)

    def tp_plan(self) -> dict[str, Any]:
        """Gate and up column-parallel (``hidden / tp`` columns per rank), down row-parallel (all-reduced)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


class Block(nn.Module):
    """Pre-norm (``x + f(norm(x))``, Llama) or, with ``post_norm``, OLMo 2's ``x + norm(f(x))`` for each sublayer."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.post_norm = cfg.post_norm
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_plus_one)
        self.attention = Attention(cfg, rotary=layer not in cfg.nope_layers)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_plus_one)
        self.feed_forward = FeedForward(cfg)
        # Gemma 2/3's "sandwich": each sublayer's output is normalised again before the residual add
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_plus_one) if cfg.sandwich_norm else None
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_plus_one) if cfg.sandwich_norm else None

    def _post(self, norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        return x if norm is None else norm(x)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: KVCache | None = None,
        mask: AttentionMask | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        if self.post_norm:
            attn, present = self.attention(x, cos, sin, past, mask)
            h = x + self.attention_norm(attn)
            return h + self.ffn_norm(self.feed_forward(h)), present
        # the residual adds happen inside the output projections' GEMMs and x's two gradients meet in the norms'
        # backward kernels (crosstrain.models.fused_linear, RMSNorm.with_residual) where nothing else is in between
        x, normed = self.attention_norm.with_residual(x)
        if self.post_attention_norm is None and type(self.attention) is Attention and hookless(self.attention):
            h, present = self.attention(normed, cos, sin, past, mask, residual=x)
        else:
            attn, present = self.attention(normed, cos, sin, past, mask)
            h = x + self._post(self.post_attention_norm, attn)
        h, normed = self.ffn_norm.with_residual(h)
        if self.post_ffn_norm is None and type(self.feed_forward) is FeedForward and hookless(self.feed_forward):
            return self.feed_forward(normed, residual=h), present
        return h + self._post(self.post_ffn_norm, self.feed_forward(normed)), present

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
                       layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        if self.post_norm:
            h = x + self.attention_norm(self.attention.forward_cached(x, cos, sin, cache, layer, mask))
            return h + self.ffn_norm(self.feed_forward(h))
        attn = self.attention.forward_cached(self.attention_norm(x), cos, sin, cache, layer, mask)
        h = x + self._post(self.post_attention_norm, attn)
        return h + self._post(self.post_ffn_norm, self.feed_forward(self.ffn_norm(h)))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits ``[B, T, vocab]``."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads and not cfg.attn_head_dim:
            raise ValueError(f"model.dim={cfg.dim} must be divisible by model.n_heads={cfg.n_heads}")
        if cfg.n_heads % cfg.kv_heads:
            raise ValueError(f"model.n_heads={cfg.n_heads} must be divisible by model.n_kv_heads={cfg.kv_heads}")
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_plus_one)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.local_rope_theta:  # windowed layers rotate with their own base (Gemma 3)
            cos, sin = rope_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.local_rope_theta)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        self.tie_weights()
        self.init_weights()

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialise parameters and rope tables; used after building on the meta device."""
        cfg = self.config
        cos, sin = rope_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        device = buffer_device or self.rope_cos.device
        if device.type != "meta":
            self.rope_cos = cos.to(device)
            self.rope_sin = sin.to(device)
            if cfg.local_rope_theta:
                cos, sin = rope_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.local_rope_theta)
                self.rope_local_cos, self.rope_local_sin = cos.to(device), sin.to(device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks():
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1,
                        block.feed_forward.w3):
                nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(block.attention.wo.weight, std=out_std)
            nn.init.normal_(block.feed_forward.w2.weight, std=out_std)
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo,
                        block.feed_forward.w1, block.feed_forward.w3, block.feed_forward.w2):
                if lin.bias is not None:  # zeros draw no random numbers: the weights' RNG stream is unchanged
                    nn.init.zeros_(lin.bias)
            for norm in (block.attention_norm, block.ffn_norm, block.attention.q_norm, block.attention.k_norm,
                         block.post_attention_norm, block.post_ffn_norm):
                if norm is not None:
                    norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; with ``doc_ids [B, T]`` (packed documents) attention stays inside each document and
        positions restart at every document start (:mod:`crosstrain.models.document_mask`)."""
        logits, _ = self.forward_with_cache(tokens, None, doc_ids=doc_ids)
        return logits

    def forward_with_cache(
        self, tokens: torch.Tensor, past: list[KVCache] | None, *, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[KVCache]]:
        """Run with an optional per-layer ``(k, v)`` cache ``[B, kv_heads, T_past, head_dim]``.

        Returns logits (or hidden states on a stage without ``output``) and the new per-layer caches.
        """
        h = self._embed(tokens)
        seqlen = h.shape[1]
        segments = None
        if doc_ids is None:
            start = 0 if past is None else past[0][0].shape[2]
            positions: torch.Tensor | slice = slice(start, start + seqlen)
        else:
            if past is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a KV cache")
            from crosstrain.models.document_mask import document_positions, segment_index

            positions = document_positions(doc_ids)  # per-row tables [B, T, head_dim/2]
            segments = segment_index(doc_ids)
        shared = segments is not None or self.config.attn_softcap  # soft-capped global layers leave SDPA too
        masks = {w: AttentionMask(seqlen, w, segments) if w or shared else None
                 for w in {self.config.window_of(int(key)) for key in self.layers}}  # built once, shared by layers
        presents: list[KVCache] = []
        for i, (key, block) in enumerate(self.layers.items()):
            cos, sin = self._rope_of(int(key))
            window = self.config.window_of(int(key))
            h, present = block(h, cos[positions], sin[positions], None if past is None else past[i], masks[window])
            presents.append(present)
        return self._head(h), presents

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings (times ``sqrt(dim)`` with ``embed_scale``, in their dtype as Gemma does); inner pipeline
        stages receive hidden states and pass them through."""
        if self.tok_embeddings is None:
            return tokens
        h = self.tok_embeddings(tokens)
        if self.config.embed_scale:
            h = h * torch.tensor(self.config.dim**0.5, dtype=h.dtype, device=h.device)
        return h

    def _rope_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full ``cos``/``sin`` tables block ``layer`` rotates with (Gemma 3: local ones on windowed layers)."""
        if self.config.local_rope_theta and self.config.window_of(layer):
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (with ``final_softcap``: ``cap * tanh(logits / cap)``, Gemma 2) where present."""
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
            if self.config.final_softcap and self.output.out_features > 1:  # a scalar (reward/value) head is not
                h = softcap_scores(h, self.config.final_softcap)
        return h

    # -- the generation cache protocol (crosstrain.generation.engine) ------------------------------------
    def allocate_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                          device: torch.device | None = None) -> StaticKVCache:
        """A static cache of ``max_len`` slots per row for this module's blocks (see :class:`StaticKVCache`)."""
        if max_len > self.config.max_seq_len:
            from crosstrain.errors import ConfigError

            raise ConfigError(f"prompt + max_new_tokens = {max_len} tokens exceeds model.max_seq_len "
                              f"{self.config.max_seq_len}; shorten the prompts or lower max_new_tokens")
        return StaticKVCache(len(self.layers), batch, max_len, dtype, device)

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                       attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[B, L, vocab]`` for ``tokens [B, L]`` at per-row ``positions``, appended to ``cache`` in place;
        ``attention_mask [B, cache.length + L]`` marks real tokens (False: left padding; None: no padding); a cache in
        static mode (:meth:`StaticKVCache.make_static`, the compiled decode step) takes ``[B, cache.max_len]``."""
        h = self._embed(tokens)
        masks = {w: cache.attention_mask(attention_mask, tokens.shape[1], window=w)
                 for w in {self.config.window_of(int(key)) for key in self.layers}}
        for i, (key, block) in enumerate(self.layers.items()):
            # called directly, not via __call__: wrappers (activation checkpointing, torch.compile, FSDP2 hooks)
            # are for training; crosstrain.generation.sharded unshards FSDP2 modules once for the whole call
            block = getattr(block, "_checkpoint_wrapped_module", block)
            cos, sin = self._rope_of(int(key))
            h = cast(Block, getattr(block, "_orig_mod", block)).forward_cached(
                h, cos[positions], sin[positions], cache, i, masks[self.config.window_of(int(key))])
        cache.advance(tokens.shape[1])
        return self._head(h)

    def blocks(self) -> list[Block]:
        """The transformer blocks this module holds (all of them, or one pipeline stage's)."""
        return [cast(Block, b) for b in self.layers.values()]

    def tie_weights(self) -> None:
        """Share ``tok_embeddings.weight`` with ``output`` when ``tie_embeddings`` (tensor parallelism calls it
        again after sharding: both plans shard the ``[vocab, dim]`` weight on dim 0, so one DTensor serves)."""
        if self.config.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    # -- parallel plans (crosstrain.parallel.plan) --------------------------------------------------
    def tp_plan(self) -> dict[str, Any]:
        """The embedding and the LM head, both sharded over the vocabulary, with replicated inputs and outputs
        (blocks bring their own plans; norm weights stay replicated plain parameters)."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        if self.output is not None:
            plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(),
                                             use_local_output=True)
        if self.tok_embeddings is not None:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        return plan

    def pipeline_split(self, pp: int, stage: int) -> None:
        """Keep stage ``stage``'s contiguous run of blocks (earlier stages take the remainder), the embedding on
        the first stage and ``norm``/``output`` on the last. ``layers`` keys keep their global index."""
        from crosstrain.parallel.pp import stage_layers

        keys = list(self.layers.keys())
        keep = {keys[i] for i in stage_layers(len(keys), pp, stage)}
        for key in keys:
            if key not in keep:
                del self.layers[key]
        if stage != 0:
            self.tok_embeddings = None
        if stage != pp - 1:
            self.norm = None
            self.output = None

    def ac_units(self) -> dict[str, int]:
        """Each block this module holds (``layers.<i>``) -> its global index ``i``."""
        return {f"layers.{key}": int(key) for key in self.layers}

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (6N + attention), as in the PaLM/torchtitan MFU estimate; a windowed layer
        attends to at most ``window`` keys, so it counts ``min(seq_len, window)`` of them."""
        cfg = self.config
        keys = sum(min(seq_len, cfg.window_of(i) or seq_len) for i in range(cfg.n_layers))
        return 6 * self.num_params(exclude_embeddings=True) + 12 * cfg.n_heads * cfg.head_dim * keys


def build_gpt(preset: str = "tiny", **overrides: object) -> GPT:
    """Build a GPT from a preset name with field overrides (e.g. ``vocab_size=256``)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model.preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset].to_dict()
    base.update({k: v for k, v in overrides.items() if v is not None})
    return GPT(GPTConfig(**base))
