"""Loading a generic run's checkpoint back into its transformers class, and writing it as ``save_pretrained`` does.

Checkpoint tensors already carry transformers' names (the generic model *is* the transformers class, see
:mod:`.wrapper`), so nothing is renamed: the run's own model is rebuilt from its config, the consolidated tensors are
loaded with every name and shape checked, and ``save_pretrained`` writes ``config.json``, the safetensors shards
and ``generation_config.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from crosstrain.checkpoint.atomic import disk_errors
from crosstrain.errors import CheckpointError
from crosstrain.models.generic.wrapper import GenericCausalLM


def is_generic_run(config: Any) -> bool:
    """Did the run (its :class:`~crosstrain.config.Config`, None when unknown) train on the generic path?"""
    if config is None or config.model.import_path:
        return False
    from crosstrain.errors import ConfigError
    from crosstrain.models.family import family_for_run

    try:
        return family_for_run(config).path == "generic"
    except ConfigError:  # its model.init_from folder is gone: the native loader says what is missing
        return False


@torch.no_grad()
def load_generic(config: Any, state: dict[str, torch.Tensor], source: str) -> GenericCausalLM:
    """The run's model in fp32 eval mode holding ``state`` (a consolidated checkpoint, adapters already merged)."""
    from crosstrain.models.generic.build import build
    from crosstrain.models.generic.config import config_from_run

    model = build(config_from_run(config))
    own = model.state_dict()
    tied = {k for k, v in own.items() for j, w in own.items() if j != k and v.data_ptr() == w.data_ptr()}
    missing = sorted(set(own) - set(state) - tied)
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        problem = (f"{wrong[0]} has shape {tuple(state[wrong[0]].shape)}, the model {tuple(own[wrong[0]].shape)}"
                   if wrong else f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}")
        raise CheckpointError(f"{source} does not fit the run's {type(model).__name__} ({problem}); export the run "
                              "it was trained in")
    for name, tensor in state.items():
        own[name].copy_(tensor.to(own[name].dtype))
    return model.eval()


def save_hf(model: GenericCausalLM, folder: str | os.PathLike[str], *, dtype: torch.dtype,
            max_shard_size: str | int) -> list[str]:
    """``model.save_pretrained(folder)`` in ``dtype`` (safetensors shards of at most ``max_shard_size``); the
    names of the files written."""
    model.to(dtype)
    model.config.dtype = dtype
    with disk_errors(folder):
        model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return sorted(p.name for p in Path(folder).iterdir())
