"""ParallelDims: the sizes of the device-mesh dimensions, checked against the world size and the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crosstrain.errors import ConfigError

#: mesh dimension names, outermost first (same order as :data:`crosstrain.collective.MESH_DIMS`).
DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "ep", "tp")
#: the physical dims when ``ep > 1``: ``dp_shard`` is split into ``dp_shard_out x ep`` (see docs/parallelism.md).
EP_DIM_NAMES = ("pp", "dp_replicate", "dp_shard_out", "ep", "tp")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions; ``dp_shard=-1`` means "whatever is left of the world size".

    ``dp_replicate`` is DDP (or the replicate dim of HSDP), ``dp_shard`` FSDP2, ``tp`` tensor parallel,
    ``pp`` pipeline parallel. ``ep`` expert parallel: its ranks are carved from the ``dp_shard`` ranks (as in
    torchtitan), so it must divide ``dp_shard`` and does not multiply the world size.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    #: why ``dp_shard=-1`` became DDP or FSDP2 (a :class:`crosstrain.parallel.layout.LayoutChoice`), when known
    layout_choice: Any = field(default=None, repr=False, compare=False)

    def resolve(self) -> ParallelDims:
        """Fill ``dp_shard=-1`` and check that the product equals the world size; returns ``self``."""
        for name in ("dp_replicate", "tp", "pp", "ep", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                key = name if name == "world_size" else f"parallel.{name}"
                raise ConfigError(f"{key}={value!r} must be an integer >= 1")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ConfigError(f"parallel.dp_shard={self.dp_shard!r} must be an integer >= 1, or -1 for the rest")
        others = self.dp_replicate * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"parallel.dp_replicate={self.dp_replicate} x parallel.tp={self.tp} x parallel.pp={self.pp} "
                    f"= {others} does not divide the world size {self.world_size}; change them so it does"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel.dp_replicate={self.dp_replicate} x parallel.dp_shard={self.dp_shard} x "
                f"parallel.tp={self.tp} x parallel.pp={self.pp} = {product} but the world size is "
                f"{self.world_size}; make the product equal the number of processes (or set parallel.dp_shard=-1)"
            )
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard} (expert-parallel ranks are "
                "carved from the data-parallel shard ranks); pick a divisor"
            )
        return self

    # -- derived ----------------------------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Number of data-parallel replicas (``dp_replicate * dp_shard``; needs a resolved ``dp_shard``)."""
        return self.dp_replicate * max(self.dp_shard, 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def mesh_shape(self) -> dict[str, int]:
        """Physical dimension name -> size, in mesh order (size-1 dims kept so plans can name them).

        With ``ep > 1`` the ``dp_shard`` ranks are laid out as ``dp_shard_out x ep`` (``dp_shard_out =
        dp_shard / ep``); :func:`crosstrain.parallel.build_mesh` flattens the two back into ``dp_shard``.
        """
        if self.ep == 1:
            return {name: int(getattr(self, name)) for name in DIM_NAMES}
        sizes = {**{name: int(getattr(self, name)) for name in DIM_NAMES}, "dp_shard_out": self.dp_shard // self.ep}
        return {name: sizes[name] for name in EP_DIM_NAMES}

    def describe(self) -> str:
        """``"pp=1 x dp_replicate=1 x dp_shard=2 x ep=1 x tp=2"`` (the physical mesh, see :meth:`mesh_shape`)."""
        return " x ".join(f"{k}={v}" for k, v in self.mesh_shape().items())
