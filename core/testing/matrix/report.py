"""The matrix's table and its JSON summary ``{"cells", "same", "refused", "failed", "failed_cells"}``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.testing.matrix.factors import FACTORS
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


def write(out: str | Path, outcomes: list[Outcome], result: dict[str, Any]) -> Path:
    """``OUT/matrix.json``: the summary and every cell; ``OUT/matrix.txt``: the table."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    cells = [{**dict(zip(FACTORS, o.cell.row(), strict=True)), "status": o.status, "detail": o.detail,
              "max_rel": {k: (v if math.isfinite(v) else None) for k, v in o.max_rel.items()}} for o in outcomes]
    atomic_write(folder / "matrix.json", json.dumps({**result, "cell_results": cells}, indent=1) + "\n")
    atomic_write(folder / "matrix.txt", table(outcomes) + "\n")
    return folder / "matrix.json"
