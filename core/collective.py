"""The Collective interface: process groups, collectives and device meshes on torch.distributed.

One implementation serves every backend: it is bound to a :class:`~crosstrain.device.Device`, whose
``dist_backend`` names the torch.distributed backend (gloo, nccl, hccl, ...). Each call is a direct
torch.distributed call, so the wrapper adds no measurable overhead. With ``world_size == 1`` and no
process group, every op is a local no-op (single-process mode).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from crosstrain.device import Device
from crosstrain.distenv import DistEnv
from crosstrain.errors import CollectiveError
from crosstrain.fault.elastic import elastic_store
from crosstrain.fault.timeout import guarded

#: mesh dimension names, outermost first; any subset may be used, in this order. ``dp_shard_out`` is the part of
#: ``dp_shard`` outside expert parallelism when ``ep > 1`` (see crosstrain.parallel.mesh).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "dp_shard_out", "ep", "tp")

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


# torch >= 2.11 renamed the tensor-in/tensor-out collectives; keep working on the older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(op: str | dist.ReduceOp) -> Any:
    if not isinstance(op, str):
        return op
    try:
        return _OPS[op]
    except KeyError:
        raise CollectiveError(f"unknown reduce op {op!r}; use one of {', '.join(_OPS)}") from None


class Collective:
    """Collectives for one process, on the device's torch.distributed backend."""

    def __init__(self, device: Device, env: DistEnv | None = None) -> None:
        self.device = device
        self.env = env or DistEnv.from_env()
        self.timeout = datetime.timedelta(minutes=10)
        self._default_pg: Any = None
        self._default_single = True

    # -- process group ----------------------------------------------------------------------------
    def init(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Join the job's process group (no-op in single-process mode or when already initialised)."""
        if timeout is not None:
            self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        if not self.env.distributed or dist.is_initialized():
            return
        self.env.export()
        kwargs: dict[str, Any] = {"backend": self.device.dist_backend, "timeout": self.timeout}
        if self.device.type != "cpu" and self.device.bind_process_group:
            kwargs["device_id"] = self.device.device_for_local_rank(self.env.local_rank)
        store = elastic_store(self.timeout)  # fresh keys per elastic restart (torchrun reuses its store)
        if store is not None:
            kwargs.update(store=store, rank=self.env.rank, world_size=self.env.world_size)
        dist.init_process_group(**kwargs)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def initialized(self) -> bool:
        return dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.env.rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    def _single(self, group: Any) -> bool:
        """True when there is nobody to talk to (no process group, or a group of one)."""
        if group is None:
            # the default group's size cannot change while it exists: look it up once per process group
            pg = dist.group.WORLD if dist.is_initialized() else None
            if pg is not self._default_pg:
                self._default_pg = pg
                self._default_single = pg is None or dist.get_world_size() == 1
            return self._default_single
        return not dist.is_initialized() or dist.get_world_size(group) == 1

    # -- collectives ------------------------------------------------------------------------------
    @guarded("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", group: Any = None,
                   async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place across the group."""
        if self._single(group):
            return None
        return dist.all_reduce(tensor, op=_reduce_op(op), group=group, async_op=async_op)

    @guarded("all_gather")
    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        """Gather ``tensor`` from every rank into ``output`` (``world_size`` times larger on dim 0)."""
        if self._single(group):
            output.copy_(tensor.reshape(output.shape))
            return None
        return _all_gather_single(output, tensor, group=group, async_op=async_op)

    @guarded("reduce_scatter")
    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, op: str | dist.ReduceOp = "sum",
                       group: Any = None, async_op: bool = False) -> Any:
        """Reduce ``tensor`` across ranks and keep this rank's 1/world_size slice of dim 0 in ``output``."""
        if self._single(group):
            output.copy_(tensor.reshape(output.shape))
            return None
        return _reduce_scatter_single(output, tensor, op=_reduce_op(op), group=group, async_op=async_op)

    @guarded("broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
        if self._single(group):
            return None
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    @guarded("all_to_all")
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor,
                   output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None,
                   group: Any = None, async_op: bool = False) -> Any:
        """All-to-all on dim 0, with optional uneven splits (already agreed; see :meth:`exchange_splits`)."""
        if self._single(group):
            output.copy_(tensor.reshape(output.shape))
            return None
        return dist.all_to_all_single(
            output, tensor,
            output_split_sizes=list(output_split_sizes) if output_split_sizes is not None else None,
            input_split_sizes=list(input_split_sizes) if input_split_sizes is not None else None,
            group=group, async_op=async_op,
        )

    @guarded("exchange_splits")
    def exchange_splits(self, input_split_sizes: Sequence[int], group: Any = None) -> list[int]:
        """Tell every peer how many rows it gets from this rank; return how many this rank gets from each.

        Raises :class:`CollectiveError` when the number of splits does not match the group size.
        """
        size = 1 if self._single(group) else dist.get_world_size(group)
        if len(input_split_sizes) != size:
            raise CollectiveError(
                f"all_to_all on rank {self.rank}: {len(input_split_sizes)} input splits for a group of {size}"
            )
        if size == 1:
            return list(input_split_sizes)
        send = torch.tensor(list(input_split_sizes), dtype=torch.int64, device=self._comm_device())
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return [int(v) for v in recv.tolist()]

    def all_to_all_uneven(self, tensor: torch.Tensor, input_split_sizes: Sequence[int],
                          group: Any = None) -> tuple[torch.Tensor, list[int]]:
        """Send ``input_split_sizes[i]`` rows of ``tensor`` to rank ``i``; return received rows and splits.

        The split sizes are agreed across ranks first, so a mismatch is an error instead of a hang.
        """
        if sum(input_split_sizes) != tensor.shape[0]:
            raise CollectiveError(
                f"all_to_all on rank {self.rank}: splits sum to {sum(input_split_sizes)} "
                f"but the tensor has {tensor.shape[0]} rows"
            )
        out_splits = self.exchange_splits(input_split_sizes, group)
        output = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
        self.all_to_all(output, tensor.contiguous(), out_splits, list(input_split_sizes), group=group)
        return output, out_splits

    @guarded("barrier")
    def barrier(self, group: Any = None) -> None:
        if self._single(group):
            return
        if self.device.type == "cpu":
            dist.barrier(group=group)
        else:
            dist.barrier(group=group, device_ids=[self.device.current_device().index or 0])

    @guarded("send")
    def send(self, tensor: torch.Tensor, dst: int, group: Any = None) -> None:
        dist.send(tensor, dst=dst, group=group)

    @guarded("recv")
    def recv(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        dist.recv(tensor, src=src, group=group)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None) -> Any:
        return dist.isend(tensor, dst=dst, group=group)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None) -> Any:
        return dist.irecv(tensor, src=src, group=group)

    @guarded("all_gather_object")
    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        """Gather a small picklable object from every rank (uses torch's object collectives)."""
        if self._single(group):
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    # -- meshes -----------------------------------------------------------------------------------
    def mesh(self, dims: dict[str, int]) -> Any:
        """A ``DeviceMesh`` with the given named dims (size-1 dims kept so plans can name them).

        Dims are laid out in :data:`MESH_DIMS` order; their product must equal the world size.
        """
        from torch.distributed.device_mesh import init_device_mesh

        unknown = set(dims) - set(MESH_DIMS)
        if unknown:
            raise CollectiveError(f"unknown mesh dims {sorted(unknown)}; allowed: {', '.join(MESH_DIMS)}")
        names = tuple(d for d in MESH_DIMS if d in dims)
        shape = tuple(int(dims[d]) for d in names)
        product = 1
        for s in shape:
            product *= s
        if product != self.world_size:
            layout = " x ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
            raise CollectiveError(f"mesh {layout} has {product} ranks but the world size is {self.world_size}")
        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)

    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if self.device.type == "cpu" else self.device.current_device()


def served_device(device: torch.device, group: Any = None) -> torch.device:
    """Where ``group`` runs a collective on a tensor that lives on ``device``: there when one of the group's
    backends serves that device type, else on the host (or, with no host backend, the first device type served).

    ``dist.get_backend_config`` lists each backend with what it serves: ``"cpu:gloo,cuda:nccl"``; a plain ``gloo``
    is ``"cpu:gloo,cuda:gloo"`` (torch's ``Backend.backend_capability``: gloo stages CUDA tensors through the
    host itself); a registered backend serves the devices it registered (simdev: ``"cpu:gloo,simdev:simgloo"``)."""
    served = [pair.split(":", 1)[0] for pair in dist.get_backend_config(group).split(",")]
    if device.type in served:
        return device
    return torch.device("cpu" if "cpu" in served else served[0])


def all_reduce_served(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> torch.Tensor:
    """``tensor`` all-reduced over ``group``, copied to where the group can reduce it (:func:`served_device`) and
    back; in place when no copy is needed. Returns the reduced tensor, on ``tensor``'s device."""
    device = served_device(tensor.device, group)
    if device == tensor.device:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(tensor.device)


def global_sums(values: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """``values`` summed over every rank (one all-reduce, in float64), divided by ``copies``: the number of ranks
    that hold the same data (tensor/pipeline-parallel peers), so the result is the sum over data-parallel ranks.
    Without a process group (or in a group of one) it is ``values / copies``."""
    out = values.detach().double().clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = all_reduce_served(out)
    return out / copies


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for tests and the single-node launcher)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
