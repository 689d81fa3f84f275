"""The job's DeviceMesh (pp x dp_replicate x dp_shard x ep x tp) and its sub-meshes."""

from __future__ import annotations

from typing import Any

from crosstrain.parallel.dims import ParallelDims


def build_mesh(collective: Any, dims: ParallelDims) -> Any:
    """A named ``DeviceMesh`` over all ranks, or ``None`` in a single-process run.

    ``collective`` is a :class:`crosstrain.collective.Collective` (already ``init()``-ed); the mesh uses its
    device type, so no backend name appears here.
    """
    if dims.dp_shard == -1:
        dims.resolve()
    if collective.world_size == 1:
        return None
    return collective.mesh(dims.mesh_shape())


def dp_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The data-parallel sub-mesh: 1-D ``dp_replicate`` or ``dp_shard``, or 2-D for HSDP; None if dp is 1."""
    if mesh is None or not dims.dp_enabled:
        return None
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        return mesh["dp_replicate", "dp_shard"]
    if dims.dp_replicate > 1:
        return mesh["dp_replicate"]
    return mesh["dp_shard"]


def sub_mesh(mesh: Any, name: str) -> Any:
    """The 1-D sub-mesh ``name`` (``"tp"``, ``"pp"``, ...), or None without a mesh."""
    return None if mesh is None else mesh[name]


def dp_rank_and_size(mesh: Any, dims: ParallelDims) -> tuple[int, int]:
    """This rank's data-parallel index and the number of data-parallel replicas (for the data sampler).

    Ranks that differ only in ``tp`` or ``pp`` read the same data.
    """
    if mesh is None:
        return 0, 1
    rep = mesh.get_local_rank("dp_replicate")
    shard = mesh.get_local_rank("dp_shard")
    return rep * dims.dp_shard + shard, dims.dp_degree
