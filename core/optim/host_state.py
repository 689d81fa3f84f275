"""What the host-memory optimizers share: fp32 optimizer state kept fp32 across ``load_state_dict``, and the
step's closure.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype and
device. The fused CPU optimizers, which hold fp32 master weights and moments for low-precision parameters,
call :func:`restore_fp32_state` afterwards to put back exact fp32 copies where they belong;
:func:`closure_loss` is shared with :class:`~crosstrain.optim.offload.OffloadOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def restore_fp32_state(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    keys: Iterable[str],
    place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Overwrite ``keys`` of each param's state with fp32 copies of the tensors in ``state_dict``.

    ``place(param, fp32_tensor)`` may move the copy (e.g. to pinned host memory); by default it stays on the
    parameter's device. Call it after ``super().load_state_dict(state_dict)``.
    """
    keys = tuple(keys)
    saved = state_dict.get("state", {})
    ids = [pid for group in state_dict.get("param_groups", []) for pid in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, param in zip(ids, params, strict=True):
        entry = saved.get(pid)
        if not entry:
            continue
        state = optimizer.state[param]
        for key in keys:
            value = entry.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            fp32 = value.detach().to(torch.float32, copy=True).contiguous()
            state[key] = place(param, fp32) if place is not None else fp32.to(param.device)


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """The loss of an optimizer step's ``closure``, run with gradients on as ``torch.optim`` does; None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
