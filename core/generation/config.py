"""What :func:`crosstrain.generation.generate` is asked to do and what it returns."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from crosstrain.errors import ConfigError


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings. ``greedy`` takes the argmax; otherwise tokens are sampled from the model's distribution
    at ``temperature``, restricted to the ``top_k`` most likely tokens (0 = off) and to the nucleus of mass
    ``top_p`` (1.0 = off). A row stops after emitting one of ``stop_tokens``; later slots hold ``pad_token``.

    ``compile`` runs each decode step as one ``torch.compile``-d, static-shape forward over the whole
    preallocated cache under a mask (HF ``StaticCache`` + compile, gpt-fast). Off by default: the first call
    for each (batch, prompt width + ``max_new_tokens``) shape compiles, which costs far more than one call's
    decoding saves (docs/generation.md has the figures); it pays when the same shapes repeat many times on an
    unsharded model."""

    max_new_tokens: int = 32
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number > 0, got {self.temperature}; "
                              "use greedy=True for argmax decoding")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}")
        if self.pad_token < 0 or any(t < 0 for t in self.stop_tokens):
            raise ConfigError(f"pad_token and stop_tokens must be token ids >= 0, got pad_token={self.pad_token}, "
                              f"stop_tokens={self.stop_tokens}")


@dataclass
class GenerationOutput:
    """Rows in prompt order. ``P`` is the longest prompt, ``T`` the number of decoding steps run (at most
    ``max_new_tokens``; fewer when every row stopped early)."""

    sequences: torch.Tensor  # [B, P + T] long: left-padded prompts, then the new tokens (pad after a stop)
    prompt_mask: torch.Tensor  # [B, P] bool: real prompt tokens
    tokens: torch.Tensor  # [B, T] long: the new tokens
    logprobs: torch.Tensor  # [B, T] float32: log p(token) under the model's own logits (0 where mask is False)
    mask: torch.Tensor  # [B, T] bool: True up to and including the stop token
    lengths: torch.Tensor  # [B] long: number of new tokens, mask.sum(1)
