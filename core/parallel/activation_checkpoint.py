"""Per-block activation checkpointing (``none`` | ``full`` | ``every:N``) and opt-in per-block torch.compile."""

from __future__ import annotations

from typing import cast

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from crosstrain.errors import ConfigError


def parse_ac(mode: str) -> int:
    """``"none"`` -> 0, ``"full"`` -> 1, ``"every:N"`` -> N (checkpoint every N-th block)."""
    text = str(mode).strip().lower()
    if text in ("", "none", "off", "false"):
        return 0
    if text in ("full", "all", "true"):
        return 1
    if text.startswith("every:"):
        try:
            n = int(text.split(":", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return n
    raise ConfigError(f"activation checkpoint mode {mode!r} is not allowed; use none, full or every:N (N >= 1)")


def apply_ac(model: nn.Module, mode: str) -> int:
    """Wrap blocks of ``model.layers`` in a non-reentrant checkpoint wrapper; returns how many were wrapped.

    The block index (the ModuleDict key) decides ``every:N``, so pipeline stages agree with the full model.
    """
    every = parse_ac(mode)
    if not every:
        return 0
    wrapped = 0
    layers = cast(nn.ModuleDict, model.layers)
    for key in list(layers.keys()):
        if int(key) % every == 0:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
            wrapped += 1
    return wrapped


def apply_compile(model: nn.Module, backend: str | bool = True) -> None:
    """Compile each block in place (``nn.Module.compile``; parameter names do not change).

    ``backend`` True uses torch.compile's default (inductor); a string names another dynamo backend.
    """
    from crosstrain import kernels

    kernels.registry.ops()  # populate the kernel registry now: its lock must not be met inside a traced region
    kwargs = {} if backend is True else {"backend": str(backend)}
    for block in cast(nn.ModuleDict, model.layers).values():
        block.compile(**kwargs)
