"""The job's DeviceMesh (pp x dp_replicate x dp_shard x ep x tp) and its sub-meshes.

With ``ep > 1`` the expert-parallel ranks are carved from the ``dp_shard`` ranks (torchtitan's layout): the
physical dims are ``pp x dp_replicate x dp_shard_out x ep x tp`` with ``dp_shard_out = dp_shard / ep``, and
``(dp_shard_out, ep)`` is flattened back into ``dp_shard``, the FSDP mesh of the non-expert parameters. So
``mesh["dp_shard"]``, ``mesh["dp_replicate", "dp_shard"]``, ``mesh["tp"]`` and ``mesh["pp"]`` mean the same
for every ``ep``.
"""

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
    mesh = collective.mesh(dims.mesh_shape())
    if dims.ep > 1:
        _shard_mesh(mesh, dims)  # registers "dp_shard" on the root mesh, so mesh["dp_shard"] keeps working
    return mesh


def _shard_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The 1-D ``dp_shard`` mesh: a physical dim when ``ep == 1``, else ``(dp_shard_out, ep)`` flattened."""
    if dims.ep == 1:
        return mesh["dp_shard"]
    # torch caches the flattened mesh on the root and returns it again for the same name and layout; using it
    # directly avoids slicing a flattened dim from the root mesh, which torch deprecates
    return mesh["dp_shard_out", "ep"]._flatten("dp_shard")


def fsdp_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The mesh FSDP2 shards non-expert parameters over: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)``
    (HSDP; with ``dp_shard == 1`` that is replication composable with TP/PP) when ``dp_replicate > 1``."""
    if dims.dp_replicate == 1:
        return _shard_mesh(mesh, dims)
    if dims.ep == 1:
        return mesh["dp_replicate", "dp_shard"]
    from torch.distributed.device_mesh import DeviceMesh

    # how torch's fully_shard itself joins a replicate mesh and a flattened shard mesh (fsdp/_fsdp_init.py)
    return DeviceMesh._concatenate([mesh["dp_replicate"], _shard_mesh(mesh, dims)])


def dp_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The data-parallel sub-mesh: 1-D ``dp_replicate`` or ``dp_shard``, or 2-D for HSDP; None if dp is 1."""
    if mesh is None or not dims.dp_enabled:
        return None
    if dims.dp_shard > 1:
        return fsdp_mesh(mesh, dims)
    return mesh["dp_replicate"]


def dp_group(mesh: Any, dims: ParallelDims) -> Any:
    """The process group of every data-parallel rank that holds this rank's tp/pp position (``dp_replicate x
    dp_shard``, whose ``dp_shard`` includes the ``ep`` ranks): the ranks whose batches make the global batch. None
    when the data-parallel degree is 1 (a one-process run included)."""
    if mesh is None or dims.dp_degree == 1:
        return None
    if dims.dp_replicate == 1:
        return _shard_mesh(mesh, dims).get_group()
    if dims.dp_shard == 1:
        return mesh["dp_replicate"].get_group()
    physical = ("dp_replicate", "dp_shard") if dims.ep == 1 else ("dp_replicate", "dp_shard_out", "ep")
    return mesh[physical]._flatten("dp").get_group()


def ep_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The 1-D expert-parallel sub-mesh (the ranks that exchange tokens), or None when ``ep == 1`` or no mesh."""
    if mesh is None or dims.ep == 1:
        return None
    return mesh["ep"]


def dp_rank_and_size(mesh: Any, dims: ParallelDims) -> tuple[int, int]:
    """This rank's data-parallel index and the number of data-parallel replicas (for the data sampler).

    Ranks that differ only in ``tp`` or ``pp`` read the same data; ``ep`` ranks are data-parallel ranks and
    read different data.
    """
    if mesh is None:
        return 0, 1
    rep = mesh.get_local_rank("dp_replicate")
    if dims.ep > 1:
        # the flattened dp_shard index, outer-major like the flatten: dp_shard_out * ep + ep
        shard = mesh.get_local_rank("dp_shard_out") * dims.ep + mesh.get_local_rank("ep")
    else:
        shard = mesh.get_local_rank("dp_shard")
    return rep * dims.dp_shard + shard, dims.dp_degree
