"""Rotary position embeddings (Su et al. 2021, "RoFormer", arXiv:2104.09864) and the scaled variants Hugging Face
checkpoints use, computed exactly as transformers 5 does (``transformers/modeling_rope_utils.py``, the
``_compute_*_parameters`` functions, and each model's ``RotaryEmbedding.forward``).

A variant is the ``rope_parameters`` dict of a ``config.json`` (v4 ``rope_scaling``), with ``rope_type`` and its keys;
:func:`inv_freq_and_scale` returns the inverse frequencies and the factor transformers multiplies ``cos``/``sin``
by (``attention_scaling``); :func:`rope_tables` the ``[max_seq_len, rotary_dim/2]`` tables crosstrain's rotary
kernel reads (rotate-half convention). ``rotary_dim`` is ``int(head_dim * partial_rotary_factor)``.

``dynamic`` (NTK) and ``longrope`` change their frequencies with the length of the *current* sequence in
transformers (``dynamic_rope_update``), so no fixed table matches them beyond the original context: crosstrain
builds the table transformers uses for sequences within it (:func:`max_exact_len`) and refuses a longer
``max_seq_len``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

#: rope_type values crosstrain computes ("default" is the plain RoFormer rotary).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i / dim)``, ``i < dim/2`` (RoFormer eq. 15; transformers' ``compute_default_rope_parameters``)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def linear_inv_freq(dim: int, theta: float, factor: float) -> torch.Tensor:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): ``default / factor``, i.e. positions / factor."""
    return default_inv_freq(dim, theta) / factor


def dynamic_inv_freq(dim: int, theta: float, factor: float, seq_len: int, max_position: int) -> torch.Tensor:
    """Dynamic NTK (transformers ``_compute_dynamic_ntk_parameters``): the base becomes
    ``theta * (factor * L / max_position - (factor - 1))^(dim / (dim - 2))`` with ``L = max(seq_len,
    max_position)``; for ``L = max_position`` that is ``theta`` itself, the plain table."""
    length = max(seq_len, max_position)
    base = theta * ((factor * length / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(dim, base)


def llama3_inv_freq(dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position: int) -> torch.Tensor:
    """Llama 3.1 (transformers ``_compute_llama3_parameters``): wavelengths ``2 pi / f`` above
    ``original / low_freq_factor`` are divided by ``factor``, below ``original / high_freq_factor`` kept, and in
    between interpolated with ``s = (original / wavelen - low) / (high - low)``: ``(1 - s) f / factor + s f``."""
    inv_freq = default_inv_freq(dim, theta)
    low_freq_wavelen = original_max_position / low_freq_factor
    high_freq_wavelen = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``; Peng et al. 2023,
    arXiv:2309.00071 eq. 22)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(dim: int, theta: float, p: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, "by parts" interpolation + temperature; transformers ``_compute_yarn_parameters``):
    dimensions rotating more than ``beta_fast`` times over the original context keep their frequency, fewer than
    ``beta_slow`` are interpolated (``/ factor``), a linear ramp in between; cos/sin are scaled by
    ``attention_factor`` (default :func:`yarn_mscale`, or its ``mscale / mscale_all_dim`` ratio)."""
    factor = float(p["factor"])
    original = int(p["original_max_position_embeddings"])
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def longrope_parameters(dim: int, theta: float, p: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753; transformers ``_compute_longrope_parameters``) for sequences
    within ``original_max_position_embeddings``: ``1 / (short_factor_i * theta^(2i/dim))``, cos/sin scaled by
    ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original))``)."""
    factor = float(p["factor"])
    original = int(p["original_max_position_embeddings"])
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**shape), float(attention_factor)


def inv_freq_and_scale(dim: int, theta: float, scaling: Mapping[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` and the cos/sin factor of the variant ``scaling`` (None: plain rotary)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return default_inv_freq(dim, theta), 1.0
    assert scaling is not None
    if kind == "linear":
        return linear_inv_freq(dim, theta, float(scaling["factor"])), 1.0
    if kind == "dynamic":
        original = int(scaling["original_max_position_embeddings"])
        return dynamic_inv_freq(dim, theta, float(scaling["factor"]), original, original), 1.0
    if kind == "llama3":
        return llama3_inv_freq(dim, theta, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                               float(scaling["high_freq_factor"]),
                               int(scaling["original_max_position_embeddings"])), 1.0
    if kind == "yarn":
        return yarn_parameters(dim, theta, scaling)
    if kind == "longrope":
        return longrope_parameters(dim, theta, scaling)
    raise ValueError(f"rope_type {kind!r} is not one of {', '.join(ROPE_TYPES)}")


def max_exact_len(scaling: Mapping[str, Any] | None) -> int | None:
    """The longest sequence a fixed table matches transformers for: the original context of ``dynamic`` and
    ``longrope`` (whose frequencies change beyond it), None (no limit) for the others."""
    if scaling and scaling.get("rope_type") in ("dynamic", "longrope"):
        return int(scaling["original_max_position_embeddings"])
    return None


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables ``[max_seq_len, head_dim/2]`` for the rotate-half convention (``head_dim``: the
    rotated channels), times the variant's attention scaling as transformers applies it (``emb.cos() * s``)."""
    inv_freq, scale = inv_freq_and_scale(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin
