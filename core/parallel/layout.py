"""The default data-parallel layout: DDP where the training state fits comfortably on each rank, else FSDP2.

FSDP2 gathers every unit's parameters in forward and backward and reduce-scatters the gradients; DDP only
all-reduces gradient buckets, overlapped with backward. When a full replica fits, DDP is the faster of the
two (issue 21 measured 0.46 s vs 0.55 s per step for the 3.3M ``small`` GPT on 2 gloo ranks), and the memory
FSDP2 saves buys nothing. The estimate is the usual mixed-precision accounting of the ZeRO paper
(Rajbhandari et al. 2020, sec. 3.1: parameters + gradients + optimizer state per parameter) plus the model
family's activation estimate (the built-in GPT's: Korthikanti et al. 2022, "Reducing Activation Recomputation",
sec. 4.1, and the logits; see :func:`crosstrain.models.gpt_family.activation_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: DDP is chosen only when the estimate is at most this share of a rank's memory: "comfortably".
FIT_FRACTION = 0.5
#: bytes of training state per parameter: fp32 weight + fp32 gradient + DDP's gradient bucket + optimizer state.
_STATE_BYTES = {"adamw": 4 + 4 + 4 + 8, "sgd": 4 + 4 + 4 + 4}


@dataclass(frozen=True)
class LayoutChoice:
    """``layout`` is ``"ddp"`` or ``"fsdp"``; ``reason`` says why (summary.json and ``crosstrain train -v``)."""

    layout: str
    reason: str
    estimate_bytes: int = 0
    budget_bytes: int = 0


def estimate_train_bytes(config: Any, micro_batch: int) -> int:
    """Bytes one DDP rank holds while training the run's model (a registered family's, see
    :mod:`crosstrain.models.family`, with what plugins' transforms add, such as MoE experts): the training state
    per parameter plus the family's activation estimate (sources in the module docstring)."""
    from crosstrain.models.family import family_for_run, param_count

    family = family_for_run(config)
    state = param_count(config) * _STATE_BYTES.get(config.optim.name, _STATE_BYTES["adamw"])
    return state + family.activation_bytes(family.config_from_run(config), micro_batch, config.train.seq_len)


def choose_layout(dims: Any, requested: str, estimate_bytes: int, budget_bytes: int) -> LayoutChoice:
    """DDP or FSDP2 for the ``dp_shard = -1`` ranks of ``dims`` (an unresolved ``ParallelDims``).

    ``requested`` is ``parallel.layout``; ``estimate_bytes`` 0 means unknown (then FSDP2, the safe choice).
    Only a pure data-parallel job (``dp_replicate = tp = pp = ep = 1``) is ever given DDP.
    """
    if dims.world_size == 1:
        return LayoutChoice("single", "one process: no data parallelism")
    if dims.dp_shard != -1:
        return LayoutChoice("fsdp" if dims.dp_shard > 1 else "ddp",
                            f"parallel.dp_shard={dims.dp_shard} set explicitly")
    others = {k: getattr(dims, k) for k in ("dp_replicate", "tp", "pp", "ep") if getattr(dims, k) != 1}
    # parallelize() wraps a pure replica in DDP (core/parallel/model.py): name it so
    if list(others) == ["dp_replicate"] and dims.dp_replicate == dims.world_size:
        return LayoutChoice("ddp", f"parallel.dp_replicate={dims.dp_replicate} alone: a full replica per rank, DDP")
    if others:
        named = ", ".join(f"parallel.{k}={v}" for k, v in others.items())
        return LayoutChoice("fsdp", f"FSDP2 composes with {named}")
    if requested == "fsdp":
        return LayoutChoice("fsdp", "parallel.layout=fsdp")
    if requested == "ddp":
        return LayoutChoice("ddp", "parallel.layout=ddp")
    if estimate_bytes <= 0 or budget_bytes <= 0:
        return LayoutChoice("fsdp", "the training memory is unknown before the model is built (model.import_path)"
                            " or the device reports no capacity; parallel.layout=ddp forces DDP")
    gib = 2.0**30
    fits = estimate_bytes <= FIT_FRACTION * budget_bytes
    text = (f"estimated {estimate_bytes / gib:.2f} GiB per rank (weights, grads, optimizer state, activations) "
            f"{'<=' if fits else '>'} {FIT_FRACTION:.0%} of {budget_bytes / gib:.1f} GiB per rank")
    if fits:
        return LayoutChoice("ddp", f"{text}: a full replica fits, DDP is faster", estimate_bytes, budget_bytes)
    return LayoutChoice("fsdp", f"{text}: FSDP2 shards it", estimate_bytes, budget_bytes)


def apply_layout(dims: Any, choice: LayoutChoice) -> None:
    """Set ``dims`` (unresolved, ``dp_shard = -1``) to DDP over all its ranks when ``choice`` says so."""
    if choice.layout == "ddp" and dims.dp_shard == -1:
        dims.dp_replicate, dims.dp_shard = dims.world_size, 1
