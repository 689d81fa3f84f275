"""Shamir secret sharing over the prime field GF(2**521 - 1) (Shamir 1979, "How to share a secret").

A secret ``s < 2**256`` is the constant term of a random polynomial ``f`` of degree ``t - 1``; share ``i`` is
``(x_i, f(x_i))``. Any ``t`` shares give ``s = f(0) = sum_j y_j prod_{m != j} x_m / (x_m - x_j)`` (Lagrange);
fewer reveal nothing. SecAgg (Bonawitz et al. 2017, section 4) shares each client's self-mask seed and mask key
this way among its neighbours. The field is the Mersenne prime 2**521 - 1, so any 256-bit secret fits.
"""

from __future__ import annotations

import secrets

PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8)


def split(secret: int, xs: list[int], threshold: int) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of ``secret`` at the distinct non-zero points ``xs``; any ``threshold`` recover it."""
    if not 0 <= secret < PRIME:
        raise ValueError("the secret must lie in [0, 2**521 - 1)")
    if not 1 <= threshold <= len(xs) or len(set(xs)) != len(xs) or any(x % PRIME == 0 for x in xs):
        raise ValueError(f"need 1 <= threshold={threshold} <= {len(xs)} distinct non-zero points")
    coeffs = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner's rule
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def combine(shares: dict[int, int]) -> int:
    """``f(0)`` from ``{x: f(x)}`` by Lagrange interpolation; exactly the secret when ``len(shares) >= t``."""
    secret = 0
    for xj, yj in shares.items():
        num, den = 1, 1
        for xm in shares:
            if xm != xj:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        secret = (secret + yj * num * pow(den, -1, PRIME)) % PRIME
    return secret


def to_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def from_bytes(data: bytes) -> int:
    value = int.from_bytes(data, "big")
    if len(data) != SHARE_BYTES or value >= PRIME:
        raise ValueError("not a field element")
    return value
