"""Which cells the matrix runs: every cell is either refused by the rules (one line) or admitted; the plans
are a pairwise cover of the admitted product, or (``--full``) every admitted combination of the factors the
refusal rules read, the rest covered pairwise."""

from __future__ import annotations

import copy
import itertools
from functools import cache
from typing import Any

from crosstrain.errors import ConfigError
from crosstrain.testing.matrix.factors import FACTORS, RUNTIME_FACTORS, Cell
from crosstrain.testing.matrix.pairwise import Row, cover


@cache
def _fragment(item: str) -> dict[str, Any]:
    """``--set item`` as a nested dict (parsed once: the product repeats every item thousands of times)."""
    from crosstrain.config import apply_override

    raw: dict[str, Any] = {}
    apply_override(raw, item)
    return raw


def _merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


@cache
def refusal(cell: Cell) -> str | None:
    """The one-line ConfigError that ``crosstrain train --nproc <world>`` gives this cell before any worker starts
    (what ``load_config`` and :func:`check_world`, whose refusal rules are crosstrain.config.rules, raise), or None."""
    from crosstrain.config import check_world, config_from_dict

    raw: dict[str, Any] = {}
    for item in cell.overrides():
        _merge(raw, _fragment(item))
    try:
        check_world(config_from_dict(raw), cell.world)
    except ConfigError as exc:
        return str(exc)
    return None


def product() -> list[Cell]:
    return [Cell.from_row(row) for row in itertools.product(*FACTORS.values())]


def _structural(row: Row) -> Row:
    names = list(FACTORS)
    return tuple(v for name, v in zip(names, row, strict=True) if name not in RUNTIME_FACTORS)


def plan(full: bool = False) -> tuple[list[Cell], list[Cell]]:
    """``(admitted cells to run, refused cells to show)``.

    Pairwise: a cover of every pair of factor values that some admitted cell has. Full: additionally every admitted
    combination of recipe x layout x packing x MoE x LoRA at least once. Refused: one cell per distinct refusal
    line, the first in product order (each is checked to be one line and to come before any work).
    """
    admitted, refused, lines = [], [], set()
    for cell in product():
        line = refusal(cell)
        if line is None:
            admitted.append(cell.row())
        elif line not in lines:
            lines.add(line)
            refused.append(cell)
    rows = cover(admitted, _structural if full else None)
    return [Cell.from_row(r) for r in rows], refused
