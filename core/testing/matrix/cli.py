"""The matrix's command line: plan, run (references first, then each pool's cells), print, write."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from crosstrain.testing.matrix.factors import Cell
from crosstrain.testing.matrix.report import summary, table, write
from crosstrain.testing.matrix.runner import Outcome, Runner


def run_matrix(full: bool = False, out: str | None = None, log: bool = True, backend: str = "cpu",
               references: dict | None = None, keep: Callable[[Cell], bool] | None = None
               ) -> tuple[list[Outcome], dict]:
    """Plan and run the matrix with the cells on ``backend`` (the references on cpu; ``references`` shares them
    between calls, see :class:`Runner`); ``keep`` leaves out the admitted cells it returns False for. Returns
    every outcome (admitted cells, then refused ones) and the summary."""
    from crosstrain.testing.matrix.plan import plan, refusal

    start = time.monotonic()
    cells, refused = plan(full)
    cells = [c for c in cells if keep is None or keep(c)]
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if log else (lambda line: None)
    say(f"matrix: {len(cells)} admitted cells on {backend}, {len(refused)} refusals "
        f"({'full' if full else 'pairwise'})")
    runner = Runner(backend=backend, references=references)
    outcomes: list[Outcome] = []
    try:
        order = sorted(cells, key=lambda c: c.world)
        for cell in order:  # in this process, before any pool holds the cores
            runner.reference(cell)
        for i, cell in enumerate(order):
            outcomes.append(runner.run(cell))
            say(f"[{i + 1}/{len(order)}] {outcomes[-1].status}: {cell.label()} {outcomes[-1].detail}")
    finally:
        runner.close()
    outcomes += [Outcome(c, "refused", refusal(c) or "") for c in refused]
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
    p.add_argument("--out", default="matrix-out", help="folder for matrix.json and matrix.txt")
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
    outcomes, result = run_matrix(args.full, args.out, backend=args.backend)
    print(table(outcomes))
    print(json.dumps({k: result[k] for k in ("cells", "same", "refused", "failed", "failed_cells")}))
    return 1 if result["failed"] else 0
