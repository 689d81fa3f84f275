"""Per-block activation checkpointing (``none`` | ``full`` | ``every:N``) and opt-in per-block torch.compile.

The blocks are the model's ``ac_units()`` (a method, or registered with
:func:`crosstrain.parallel.register_parallel_plan`): dotted paths -> index in the full model.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from crosstrain.errors import ConfigError
from crosstrain.parallel.plan import replace_submodule, units


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
    """Wrap the model's block units in a non-reentrant checkpoint wrapper; returns how many were wrapped.

    The unit's index in the full model decides ``every:N``, so pipeline stages agree with the full model.
    """
    every = parse_ac(mode)
    if not every:
        return 0
    wrapped = 0
    for path, index in units(model).items():
        if index % every == 0:
            replace_submodule(model, path, checkpoint_wrapper(model.get_submodule(path), preserve_rng_state=False))
            wrapped += 1
    return wrapped


def apply_compile(model: nn.Module, backend: str | bool = True) -> None:
    """Compile each block unit in place (``nn.Module.compile``; parameter names do not change).

    ``backend`` True uses torch.compile's default (inductor); a string names another dynamo backend.
    """
    from crosstrain import kernels

    kernels.registry.ops()  # populate the kernel registry now: its lock must not be met inside a traced region
    kwargs = {} if backend is True else {"backend": str(backend)}
    for path in units(model):
        model.get_submodule(path).compile(**kwargs)
