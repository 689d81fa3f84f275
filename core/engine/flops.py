"""The FLOPs per training token that MFU divides by: every model a recipe runs, not only the primary one.

A trainable model runs forward and backward, about ``6N`` FLOPs per token for ``N`` parameters; a frozen one
(a reference, a teacher) runs forward only, ``2N`` (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", sec. 2.1: the backward pass costs twice the forward). A model with its own ``flops_per_token(seq_len)``
(the built-in GPT: ``6N`` + attention, PaLM's estimate) gives its training figure, so a frozen one counts a
third of it. A model of a registered family (:mod:`crosstrain.models.family`) is counted by its family, which
leaves out the parameters a token does not use (an MoE layer's unrouted experts, as the MoE plugin declares).

A trainable model with frozen weights (LoRA's base) runs three matmuls per forward one only for the weights it
trains: for a frozen weight the backward computes the input gradient (``2N``, activation gradients still flow to
the adapters below it) but no weight gradient, so ``2N`` per frozen (non-embedding) parameter is left out:
``4 N_frozen + 6 N_trained`` + attention (PaLM, Chowdhery et al. 2022, appendix B: 6N = 2N forward + 4N backward,
half of it weight gradients). The first layer's matmuls that read the frozen embedding skip their input gradient
too; that small share is still counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from crosstrain.models.family import family_of, flops_per_token

#: forward + backward FLOPs over forward FLOPs (the backward pass computes two matmuls per forward one)
TRAIN_OVER_FORWARD = 3.0


def training_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per token: its family's estimate, else the model's own ``flops_per_token(seq_len)``,
    else ``6N``."""
    family_estimate = flops_per_token(model, seq_len)
    if family_estimate is not None:
        return family_estimate
    fn = getattr(model, "flops_per_token", None)
    if callable(fn):
        return float(fn(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


def frozen_matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take no gradient outside embedding lookups (a lookup is no matmul: 6N leaves it out)."""
    embedded = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in embedded and not p.requires_grad:
            total += p.numel()
        seen.add(id(p))
    return total


def count_flops(models: Iterable[tuple[str, torch.nn.Module, bool]], seq_len: int
                ) -> tuple[float, dict[str, dict[str, Any]]]:
    """The FLOPs per token of one training step over ``(name, module, trainable)`` models, and what
    summary.json records of each (``mfu_flops``): ``trainable``, ``flops_per_token`` and ``counted`` (how)."""
    record: dict[str, dict[str, Any]] = {}
    for name, module, trainable in models:
        train = training_flops_per_token(module, seq_len)
        own = family_of(module) is not None or callable(getattr(module, "flops_per_token", None))
        flops = train if trainable else train / TRAIN_OVER_FORWARD
        how = {(True, True): "forward + backward: the model's flops_per_token",
               (False, True): "forward only: a third of the model's flops_per_token",
               (True, False): "forward + backward: 6N", (False, False): "forward only: 2N"}[(trainable, own)]
        frozen = frozen_matmul_params(module) if trainable else 0
        if frozen:  # no weight gradients for the frozen weights (module docstring)
            flops -= 2.0 * frozen
            how += f", less 2 x {frozen} frozen parameters (no weight gradient)"
        record[name] = {"trainable": trainable, "flops_per_token": flops, "counted": how}
    return sum(r["flops_per_token"] for r in record.values()), record
