"""Parallel plans of the generic model, found in what transformers declares about it.

- Block units (activation checkpointing, per-block compile, FSDP2's ``fully_shard`` groups): the modules whose
  class is in the model's ``_no_split_modules`` (the decoder layers accelerate keeps on one device).
- Tensor parallelism: the config's ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``,
  keys relative to the base model) as DTensor ``ColwiseParallel``/``RowwiseParallel`` styles (Megatron-LM's split,
  Shoeybi et al. 2019); embeddings, norms and the LM head stay replicated. A model without one, or with a style
  this file does not map, is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from crosstrain.errors import ConfigError


def decoder_layers(model: nn.Module) -> dict[str, int]:
    """Dotted path of each module whose class is in ``model._no_split_modules`` -> its index (in model order)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        core = getattr(module, "_checkpoint_wrapped_module", module)
        if path and type(core).__name__ in names and not any(path.startswith(p + ".") for p in found):
            found[path.replace("._checkpoint_wrapped_module", "")] = len(found)
    return found


def base_tp_plan(model: nn.Module) -> dict[str, str]:
    """The config's ``base_model_tp_plan`` (``{}`` when the model has none)."""
    return dict(getattr(model.config, "base_model_tp_plan", None) or {})  # type: ignore[union-attr]


def _style(name: str, key: str, model: nn.Module) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "rowwise_rep": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # a replicated input split locally over the last dim (after a gathered colwise layer)
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # the embedding sharded over the vocabulary, as the native GPT's (core/models/gpt.py)
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    if name not in styles:
        raise ConfigError(f"parallel.tp: {type(model).__name__}'s base_model_tp_plan shards {key} as {name!r}, which "
                          f"the generic path does not map (it maps {', '.join(styles)}); set parallel.tp=1")
    return styles[name]()


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """``base_model_tp_plan`` expanded over ``model``'s module names (``*`` = one path component) as DTensor styles."""
    plan = base_tp_plan(model)
    if not plan:
        raise ConfigError(f"parallel.tp > 1 needs a tensor-parallel plan, and transformers' {type(model).__name__} "
                          "has no base_model_tp_plan; set parallel.tp=1")
    prefix = getattr(model, "base_model_prefix", "")
    names = [n for n, _ in model.named_modules()]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        full = f"{prefix}.{key}" if prefix else key
        pattern = re.compile("^" + re.escape(full).replace(r"\*", r"[^.]+") + "$")
        for name in names:
            if pattern.match(name):
                out[name] = _style(style, key, model)
    return out
