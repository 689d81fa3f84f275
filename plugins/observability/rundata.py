"""A run dir's records as the report reads them: tolerant of a run still going (a cut last line, no summary)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # being written right now
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


@dataclass
class RunData:
    name: str
    path: Path
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None

    @property
    def live(self) -> bool:
        """No summary.json yet: the run is still going (or died)."""
        return self.summary is None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        return numeric(self.metrics, key)

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.metrics:
            seen.update(dict.fromkeys(record))
        return [k for k in seen if k != "step"]


def numeric(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def load_run(path: str | Path) -> RunData:
    path = Path(path)
    if not (path / "metrics.jsonl").exists():
        from crosstrain.errors import ConfigError

        raise ConfigError(f"{str(path)!r} is not a run dir (no metrics.jsonl); pass the --run-dir of a training run")
    ranks = {}
    for f in sorted((path / "ranks").glob("metrics.rank*.jsonl")):
        match = re.fullmatch(r"metrics\.rank(\d+)\.jsonl", f.name)
        if match:
            ranks[int(match.group(1))] = read_jsonl(f)
    summary = None
    if (path / "summary.json").exists():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except ValueError:
            summary = None
    return RunData(path.resolve().name, path, read_jsonl(path / "metrics.jsonl"), read_jsonl(path / "events.jsonl"),
                   ranks, summary)
