"""Turns a device's out-of-memory error into crosstrain's one line that names what makes the run fit."""

from __future__ import annotations

from typing import Any

from crosstrain.errors import DeviceOutOfMemoryError


def fit_hint(config: Any) -> list[str]:
    """The memory savers this run has not turned on yet, as ``key=value (what it does)``."""
    hints = []
    if config.parallel.dp_shard in (-1, 1):
        hints.append("parallel.dp_shard=N with --nproc N (FSDP: parameters, gradients and optimizer state sharded)")
    if config.parallel.activation_checkpoint == "none":
        hints.append("parallel.activation_checkpoint=full (recompute activations in the backward)")
    if not config.optim.offload:
        hints.append("optim.offload=true (optimizer state in host memory)")
    return hints


def out_of_memory(exc: BaseException, config: Any) -> DeviceOutOfMemoryError:
    """The one-line error for ``exc`` (a ``torch.OutOfMemoryError``): the device's own first sentence, then the
    settings to turn on."""
    from crosstrain.errors import first_line

    what = first_line(exc, limit=400).split(". Of the allocated")[0]  # CUDA-style messages: keep size and capacity
    hints = fit_hint(config)
    fix = "; turn on " + ", or ".join(hints) if hints else "; use more devices or a smaller model/batch"
    return DeviceOutOfMemoryError(f"the run does not fit in device memory ({what}){fix}")
