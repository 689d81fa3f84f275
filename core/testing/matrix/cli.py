"""The matrix's command line: plan, run (references first, then each pool's cells), print, write.

Each finished cell is appended to ``OUT/cells.jsonl`` as it ends, so a long ``--full`` run that is stopped keeps
what it ran; ``--resume`` reruns only the cells that file lacks, and ``--shard K/N`` runs every N-th cell
(the K-th of each N, in run order), so N hosts or N runs one after another split a plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from crosstrain.testing.matrix.factors import Cell
from crosstrain.testing.matrix.report import load_done, record, summary, table, write
from crosstrain.testing.matrix.runner import Outcome, Runner


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``; ValueError with the fix otherwise."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--shard {text!r} is not K/N with 1 <= K <= N; give e.g. --shard 1/4")
    return int(k), int(n)


def run_matrix(full: bool = False, out: str | None = None, log: bool = True, shard: tuple[int, int] = (1, 1),
               resume: bool = False, backend: str = "cpu", references: dict | None = None,
               keep: Callable[[Cell], bool] | None = None) -> tuple[list[Outcome], dict]:
    """Plan and run the matrix (or shard ``K/N`` of it; with ``resume``, only the cells ``OUT/cells.jsonl`` lacks)
    with the cells on ``backend`` (the references on cpu; ``references`` shares them between calls, see
    :class:`Runner`); ``keep`` leaves out the admitted cells it returns False for. Returns every outcome (admitted
    cells, then refused ones) and the summary."""
    from crosstrain.testing.matrix.plan import plan, refusal

    start = time.monotonic()
    cells, refused = plan(full)
    cells = [c for c in cells if keep is None or keep(c)]
    k, n = shard
    order = sorted(cells, key=lambda c: c.world)[k - 1::n]
    done = load_done(out) if (resume and out) else {}
    if out and not resume:
        Path(out, "cells.jsonl").unlink(missing_ok=True)
    todo = [c for c in order if c not in done]
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if log else (lambda line: None)
    say(f"matrix: {len(cells)} admitted cells on {backend}, {len(refused)} refusals "
        f"({'full' if full else 'pairwise'}); shard {k}/{n}: {len(order)} cells, {len(order) - len(todo)} already "
        f"in {out}/cells.jsonl")
    runner = Runner(backend=backend, references=references)
    try:
        for cell in todo:  # in this process, before any pool holds the cores
            runner.reference(cell)
        for i, cell in enumerate(todo):
            done[cell] = runner.run(cell)
            if out:
                record(out, done[cell])
            say(f"[{i + 1}/{len(todo)}] {done[cell].status}: {cell.label()} {done[cell].detail}")
    finally:
        runner.close()
    outcomes = [done[c] for c in order] + [Outcome(c, "refused", refusal(c) or "") for c in refused]
    result = {"backend": backend, **summary(outcomes, time.monotonic() - start)}
    if out:
        write(out, outcomes, result)
    return outcomes, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m crosstrain.testing.matrix",
                                description="the layout x feature matrix: every cell the same as 1 process, or "
                                            "refused in one line (docs/parallelism.md)")
    p.add_argument("--full", action="store_true", help="every admitted combination of the factors the refusal "
                   "rules read (the others pairwise) instead of a pairwise cover")
    p.add_argument("--backend", default="cpu", help="the backend the cells run on; the 1-process references run "
                   "on cpu (default cpu)")
    p.add_argument("--out", default="matrix-out", help="folder for matrix.json, matrix.txt and cells.jsonl")
    p.add_argument("--shard", default="1/1", metavar="K/N", help="run every N-th cell, starting at the K-th "
                   "(1-based), of the plan's run order")
    p.add_argument("--resume", action="store_true", help="skip the cells already recorded in OUT/cells.jsonl "
                   "(by a stopped run of the same plan and shard)")
    p.add_argument("--write-docs", metavar="MD", help="write the generated refusal table into MD and exit")
    args = p.parse_args(argv)
    if args.write_docs:
        from crosstrain.testing.matrix.docs import write_docs

        write_docs(args.write_docs)
        return 0
    from crosstrain import registry

    if args.backend not in registry.backends():
        p.exit(2, f"{p.prog}: error: unknown backend {args.backend!r}; pass --backend as one of "
                  f"{', '.join(sorted(registry.backends()))} (crosstrain backends lists them)\n")
    try:
        shard = parse_shard(args.shard)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outcomes, result = run_matrix(args.full, args.out, shard=shard, resume=args.resume, backend=args.backend)
    print(table(outcomes))
    print(json.dumps({k: result[k] for k in ("cells", "same", "refused", "failed", "failed_cells")}))
    return 1 if result["failed"] else 0
