"""The QAT schemes by name: bit widths and granularity of activations and weights (torchao's 8da8w / 8da4w)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """``act_bits``: per-token asymmetric activations (0 = float); ``weight_bits``: symmetric weights, one scale
    per ``group_size`` input features (0 = per output channel)."""

    name: str
    act_bits: int
    weight_bits: int
    group_size: int = 0

    def weight_group(self, in_features: int) -> int:
        """Input features sharing one weight scale."""
        return self.group_size or in_features


SCHEMES = ("int8", "int8-act-int4-weight")


def scheme(name: str, group_size: int = 32) -> Scheme:
    """The scheme called ``name`` (``group_size`` applies to the int4 weights)."""
    if name == "int8":
        return Scheme(name, act_bits=8, weight_bits=8)
    if name == "int8-act-int4-weight":
        return Scheme(name, act_bits=8, weight_bits=4, group_size=group_size)
    from crosstrain.errors import ConfigError

    raise ConfigError(f"unknown QAT scheme {name!r}; choose one of {', '.join(SCHEMES)}")
