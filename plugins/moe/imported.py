"""The ``[moe]`` section a run really trains with: the run's own, or, when ``model.init_from`` is a Mixtral /
Qwen3-MoE folder, the checkpoint's architecture (its ``config.json``) with the run's training choices.

The architecture keys (experts, top_k, blocks, expert size, router) come from the checkpoint; setting one of them
to another non-default value is a one-line error, and so is a capacity factor (transformers drops no token, so a
capacity would change what the imported model computes). The balance loss is transformers' (``aux_loss =
"pooled"``) with coefficient ``router_aux_loss_coef``, and the z-loss is off, unless the run sets them to
non-default values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.hf_config import ARCHITECTURE, MOE_TYPES, moe_fields


def imported_fields(config: Any) -> dict[str, Any] | None:
    """:func:`~crosstrain.plugins.moe.hf_config.moe_fields` of ``model.init_from`` when it is an HF folder of an
    MoE model_type, else None."""
    from crosstrain.models.hf import is_hf_folder, read_hf_config

    folder = config.model.init_from
    if not folder or not is_hf_folder(folder):
        return None
    hf = read_hf_config(folder)
    if hf.get("model_type") not in MOE_TYPES:
        return None
    return moe_fields(hf, str(Path(folder) / "config.json"))


def effective_section(config: Any) -> MoESection:
    """The run's ``[moe]`` section, with an imported MoE checkpoint's architecture filled in (see the module)."""
    sec = config.section("moe")
    assert isinstance(sec, MoESection)
    fields = imported_fields(config)
    if fields is None:
        return sec
    where = f"model.init_from={config.model.init_from}"
    # a key left at its default follows the checkpoint (a saved run config spells every default out, so "set" cannot
    # mean "written"); any other value is the run's: a training choice, or a contradiction of the architecture
    default = MoESection()
    changed = {k for k in type(sec).model_fields if getattr(sec, k) != getattr(default, k)}
    for key in ARCHITECTURE:
        if key in changed and getattr(sec, key) != fields[key]:
            raise ConfigError(f"moe.{key}={getattr(sec, key)!r} contradicts {where} (its config.json gives "
                              f"{fields[key]!r}); remove moe.{key}")
    if sec.capacity_factor > 0:
        raise ConfigError(f"moe.capacity_factor={sec.capacity_factor} would drop tokens, which the imported "
                          f"{where} never does; set moe.capacity_factor=0 (dropless)")
    if sec.upcycle_from:
        raise ConfigError(f"moe.upcycle_from cannot be combined with {where}, which already has its experts; "
                          "remove moe.upcycle_from")
    taken = {k: fields[k] for k in (*ARCHITECTURE, "aux_loss", "aux_loss_coeff", "z_loss_coeff") if k not in changed}
    return MoESection(**{**sec.model_dump(), **taken})
