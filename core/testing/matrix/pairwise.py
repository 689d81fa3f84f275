"""A greedy covering-array generator: pick rows so that every pair of factor values that occurs in some admitted
row occurs in a picked one (all-pairs testing; the greedy step is AETG's, Cohen et al. 1997, "The AETG System",
IEEE TSE 23(7), with the candidates being every admitted row instead of random ones)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

Row = tuple[str, ...]


def pairs(row: Row) -> frozenset[tuple[int, str, int, str]]:
    """Every ``(factor i, value, factor j, value)`` with ``i < j`` that ``row`` contains."""
    return frozenset((i, row[i], j, row[j]) for i in range(len(row)) for j in range(i + 1, len(row)))


def cover(rows: Sequence[Row], each: Callable[[Row], Hashable] | None = None) -> list[Row]:
    """A subset of ``rows`` (the admitted ones) covering every pair that occurs in ``rows``.

    With ``each``, one row per distinct ``each(row)`` is picked first (the one covering most pairs still
    uncovered), so every value of ``each`` appears: ``--full`` passes the factors the refusal rules read. Ties go
    to the earlier row, so the result is deterministic.
    """
    of = {row: pairs(row) for row in rows}
    uncovered = set().union(*of.values()) if of else set()
    picked: list[Row] = []

    def take(candidates: Sequence[Row]) -> None:
        best = max(candidates, key=lambda r: len(of[r] & uncovered))
        picked.append(best)
        uncovered.difference_update(of[best])

    if each is not None:
        groups: dict[Hashable, list[Row]] = {}
        for row in rows:
            groups.setdefault(each(row), []).append(row)
        for group in groups.values():
            take(group)
    while uncovered:
        take([r for r in rows if r not in picked])
    return picked
