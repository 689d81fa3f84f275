"""SecAgg+'s sparse communication graph: every client talks to ``s`` neighbours instead of all ``n - 1``.

Bell et al. 2020 ("Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", section 3) replace
SecAgg's complete graph with a random ``k``-regular one. Ours is a circulant (Harary) graph over a shuffled
order: the sorted client ids are permuted by a numpy Generator seeded from SHA-256 of the round id, and the
client at position ``i`` is joined to positions ``i +- 1 .. i +- s//2`` (mod ``n``), plus ``i + n/2`` when ``s``
is odd (``n`` even). Every client and the server derive the same graph from the round id and the id list alone,
and a fresh round gives a fresh graph.
"""

from __future__ import annotations

import hashlib

import numpy as np


def neighbours(round_id: int, client_ids: list[int], s: int) -> dict[int, frozenset[int]]:
    """``{client: its s neighbours}`` for this round (symmetric, no self-loops)."""
    ids = sorted(client_ids)
    n = len(ids)
    if not 1 <= s <= n - 1 or (s % 2 == 1 and n % 2 == 1):
        raise ValueError(f"no {s}-regular circulant graph on {n} clients; use an even s <= {n - 1}")
    seed = int.from_bytes(hashlib.sha256(b"crosstrain-secagg-graph" + round_id.to_bytes(8, "big")).digest(), "big")
    order = [ids[i] for i in np.random.default_rng(seed).permutation(n)]
    offsets = list(range(1, s // 2 + 1)) + ([n // 2] if s % 2 else [])
    graph: dict[int, set[int]] = {c: set() for c in ids}
    for i, c in enumerate(order):
        for k in offsets:
            other = order[(i + k) % n]
            graph[c].add(other)
            graph[other].add(c)
    return {c: frozenset(v) for c, v in graph.items()}
