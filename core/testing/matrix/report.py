"""The matrix's table, its JSON summary ``{"cells", "same", "refused", "failed", "failed_cells"}``, and the
per-cell record (``cells.jsonl``, one line per finished cell) that a stopped run resumes from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.testing.matrix.factors import FACTORS, Cell
from crosstrain.testing.matrix.runner import Outcome


def table(outcomes: list[Outcome]) -> str:
    """One row per cell: its factor values, its status and why."""
    head = [*FACTORS, "status", "detail"]
    rows = [[*o.cell.row(), o.status, o.detail] for o in outcomes]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*r) for r in [head, *rows])


def summary(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    count = {s: sum(o.status == s for o in outcomes) for s in ("same", "refused", "failed")}
    return {"cells": len(outcomes), **count, "wall_s": round(wall_s, 1),
            "failed_cells": [f"{o.cell.label()}: {o.detail}" for o in outcomes if o.status == "failed"]}


def as_dict(o: Outcome) -> dict[str, Any]:
    return {**dict(zip(FACTORS, o.cell.row(), strict=True)), "status": o.status, "detail": o.detail,
            "max_rel": {k: (v if math.isfinite(v) else None) for k, v in o.max_rel.items()}}


def record(out: str | Path, o: Outcome) -> None:
    """Append one finished cell to ``OUT/cells.jsonl`` (flushed: a stopped run keeps every cell it finished)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cells.jsonl", "a") as f:
        f.write(json.dumps(as_dict(o)) + "\n")
        f.flush()


def load_done(out: str | Path) -> dict[Cell, Outcome]:
    """The cells ``OUT/cells.jsonl`` records (none when it is missing); a torn last line is skipped."""
    path = Path(out) / "cells.jsonl"
    done: dict[Cell, Outcome] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        cell = Cell.from_row(tuple(d[f] for f in FACTORS))
        rel = {k: (math.inf if v is None else v) for k, v in d["max_rel"].items()}
        done[cell] = Outcome(cell, d["status"], d["detail"], rel)
    return done


def write(out: str | Path, outcomes: list[Outcome], result: dict[str, Any]) -> Path:
    """``OUT/matrix.json``: the summary and every cell; ``OUT/matrix.txt``: the table."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "matrix.json", json.dumps({**result, "cell_results": [as_dict(o) for o in outcomes]},
                                                    indent=1) + "\n")
    atomic_write(folder / "matrix.txt", table(outcomes) + "\n")
    return folder / "matrix.json"
