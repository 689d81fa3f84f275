"""Run the matrix's admitted cells and compare each with its 1-process reference.

References run in this process, one per distinct reference config (a cell's config on one process); cells on
2 and 4 processes run on long-lived rank pools (:class:`crosstrain.testing.rank_pool.RankPool`), each a
``Trainer`` in the pool's process group, so a cell costs its training steps, not a fresh ``crosstrain train``.
A 1-process cell is a second run of its reference config in this process (a Trainer must not depend on what an
earlier one left behind). References always run on the host (``cpu``); the cells run on the runner's ``backend``,
so on another device type each cell shows that the layout on the device equals the single process on the host.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crosstrain.testing.matrix.factors import QAT_LOSS, TOLERANCE, Cell

CELL_TIMEOUT_S = 600.0


@dataclass
class Outcome:
    """A cell's result: ``same``, ``refused`` or ``failed``, with the line that says why."""

    cell: Cell
    status: str
    detail: str = ""
    max_rel: dict[str, float] = field(default_factory=dict)


Logged = dict[str, list[float]]


def train(overrides: list[str], run_dir: str) -> Logged:
    """One Trainer run in this process (its process group, if any, already up); returns each metric of
    :data:`TOLERANCE`, step by step, read back from the run's metrics.jsonl (empty on ranks other than 0)."""
    import torch

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(load_config(None, overrides), run_dir=run_dir)
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    if not trainer.is_main:
        return {}
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    return {key: [float(row.get(key, math.nan)) for row in rows] for key in TOLERANCE["fp32"]}


def train_on_rank(collective: Any, overrides: list[str], run_dir: str) -> Logged:
    """:func:`train` as a rank pool's task (every rank trains; rank 0 removes the run dir afterwards)."""
    values = train(overrides, run_dir)
    collective.barrier()
    if collective.rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return values


#: the denominator's floor: values below it (GRPO's loss, 0 by construction up to rounding) are compared absolutely
FLOOR = 0.1


def max_rel(got: list[float], ref: list[float]) -> float:
    """The largest ``|got - ref| / max(|ref|, FLOOR)`` (inf when the lengths differ or a value is not finite)."""
    if len(got) != len(ref) or not ref:
        return math.inf
    worst = 0.0
    for a, b in zip(got, ref, strict=True):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), FLOOR))
    return worst


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "?"


def compare(got: Logged, ref: Logged, precision: str, qat: bool = False) -> tuple[dict[str, float], str]:
    """Each metric's largest relative difference, and why the cell fails ("" when it is the same). With ``qat``,
    the first step's metrics at the precision's tolerance and every step's loss at :data:`QAT_LOSS`."""
    limits = dict(TOLERANCE[precision])
    rel = {key: max_rel(got.get(key, []), ref.get(key, [])) for key in limits}
    if qat:
        first = {f"{key}@1": max_rel(got.get(key, [])[:1], ref.get(key, [])[:1]) for key in limits}
        limits = {**{f"{key}@1": tol for key, tol in limits.items()}, "loss": max(limits["loss"], QAT_LOSS)}
        rel = {**first, "loss": rel["loss"]}
    steps = len(got.get("loss", []))
    if steps < 8:
        return rel, f"{steps} logged steps, fewer than 8"
    bad = [f"{key} rel {rel[key]:.2e} > {tol:g}" for key, tol in limits.items() if not rel[key] <= tol]
    return rel, ("differs from 1 process: " + ", ".join(bad)) if bad else ""


class Runner:
    """Runs cells; keeps the references' logged metrics and the rank pools between cells."""

    def __init__(self, work: str | Path | None = None, backend: str = "cpu",
                 references: dict[Cell, Logged | str] | None = None) -> None:
        self.work = Path(work or tempfile.mkdtemp(prefix="crosstrain-matrix-"))
        self.backend = backend
        #: reference config -> logged metrics; pass one dict to several runners to run each reference once
        self.references: dict[Cell, Logged | str] = {} if references is None else references
        self.pools: dict[int, Any] = {}
        self._n = 0

    def _run_dir(self) -> str:
        self._n += 1
        return str(self.work / f"run{self._n:04d}")

    def reference(self, cell: Cell) -> Logged | str:
        """The reference's logged metrics, or the last line of its error (cached per reference config)."""
        key = cell.reference()
        if key not in self.references:
            run_dir = self._run_dir()
            try:
                self.references[key] = train(key.overrides(), run_dir)
            except Exception:  # noqa: BLE001 - a failing reference fails its cells, reported with the reason
                self.references[key] = "reference: " + _last_line(traceback.format_exc())
            shutil.rmtree(run_dir, ignore_errors=True)
        return self.references[key]

    def _train(self, cell: Cell) -> Logged:
        # another device type's 1-process cells run in a 1-rank pool: torch's autograd engine sizes its device
        # threads at this process's first backward (a reference's, on cpu), so a device type registered after it
        # cannot run a backward here
        if cell.world == 1 and self.backend == "cpu":
            run_dir = self._run_dir()
            try:
                return train(cell.overrides(self.backend), run_dir)
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        from crosstrain.testing.rank_pool import RankPool

        for world in [w for w in self.pools if w != cell.world]:  # one pool at a time: 2 cores
            self.pools.pop(world).close()
        pool = self.pools.setdefault(cell.world, RankPool(cell.world, backend=self.backend))
        overrides = cell.overrides(self.backend)
        return dict(pool.run(train_on_rank, overrides, self._run_dir(), timeout=CELL_TIMEOUT_S)[0])

    def run(self, cell: Cell) -> Outcome:
        ref = self.reference(cell)
        if isinstance(ref, str):
            return Outcome(cell, "failed", ref)
        try:
            got = self._train(cell)
        except Exception as exc:  # noqa: BLE001 - a failing cell is the matrix's finding
            return Outcome(cell, "failed", _last_line(str(exc) if isinstance(exc, RuntimeError) else
                                                      traceback.format_exc()))
        rel, why = compare(got, ref, cell.precision, qat=cell.quant != "off")
        detail = why or ", ".join(f"{k} rel {v:.1e}" for k, v in rel.items())
        return Outcome(cell, "failed" if why else "same", detail, rel)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        shutil.rmtree(self.work, ignore_errors=True)
