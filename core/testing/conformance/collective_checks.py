"""Per-rank bodies of the collective conformance checks (run on real processes by run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from crosstrain.collective import Collective
from crosstrain.errors import CollectiveError


def _dev(c: Collective) -> torch.device:
    dev = c.device.device_for_local_rank(c.local_rank)
    c.device.set_device(dev)
    return dev


def check_all(c: Collective) -> dict[str, Any]:
    """Run every collective and return what this rank observed (the parent compares with expectations)."""
    dev = _dev(c)
    r, w = c.rank, c.world_size
    out: dict[str, Any] = {"rank": r, "world": w}

    t = torch.full((5,), float(r + 1), device=dev)
    c.all_reduce(t, "sum")
    out["all_reduce_sum"] = t.cpu().tolist()
    t = torch.full((3,), float(r + 1), device=dev)
    c.all_reduce(t, "max")
    out["all_reduce_max"] = t.cpu().tolist()
    t = torch.full((3,), float(r + 1), device=dev)
    c.all_reduce(t, "avg" if c.device.dist_backend != "gloo" else "sum")
    out["all_reduce_avg_or_sum"] = t.cpu().tolist()

    src = torch.arange(4, dtype=torch.float32, device=dev) + 10 * r
    gathered = torch.empty(4 * w, device=dev)
    c.all_gather(gathered, src)
    out["all_gather"] = gathered.cpu().tolist()

    full = torch.arange(2 * w, dtype=torch.float32, device=dev) * (r + 1)
    part = torch.empty(2, device=dev)
    c.reduce_scatter(part, full, "sum")
    out["reduce_scatter"] = part.cpu().tolist()

    b = torch.full((3,), float(r), device=dev)
    c.broadcast(b, src=w - 1)
    out["broadcast"] = b.cpu().tolist()

    even_in = torch.arange(w, dtype=torch.float32, device=dev) + 100 * r
    even_out = torch.empty(w, device=dev)
    c.all_to_all(even_out, even_in)
    out["all_to_all"] = even_out.cpu().tolist()

    # uneven: rank r sends (r + 1 + j) rows to rank j, rows tagged with sender and destination
    splits = [r + 1 + j for j in range(w)]
    rows = torch.cat([torch.full((n, 2), float(100 * r + j), device=dev) for j, n in enumerate(splits)])
    received, recv_splits = c.all_to_all_uneven(rows, splits)
    out["uneven_splits"] = recv_splits
    out["uneven_rows"] = received[:, 0].cpu().tolist()
    try:
        c.all_to_all_uneven(rows, splits[:-1] + [splits[-1] + 1])
        out["uneven_bad_sum"] = "no error"
    except CollectiveError as exc:
        out["uneven_bad_sum"] = str(exc)

    handle = c.all_reduce(torch.ones(2, device=dev), "sum", async_op=True)
    handle.wait()
    out["async_ok"] = True

    if w >= 2:
        if r == 0:
            c.send(torch.tensor([42.0], device=dev), dst=1)
        elif r == 1:
            buf = torch.zeros(1, device=dev)
            c.recv(buf, src=0)
            out["recv"] = buf.cpu().tolist()
        if r < 2:
            # both post a send and a receive before waiting on either (a pipeline schedule's batch_isend_irecv): a
            # send that blocked until its peer received would wait on a peer blocked in its own send
            peer = 1 - r
            got = torch.zeros(3, device=dev)
            ops = [dist.P2POp(dist.isend, torch.full((3,), float(r + 7), device=dev), peer),
                   dist.P2POp(dist.irecv, got, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            out["exchange"] = got.cpu().tolist()
    c.barrier()
    out["objects"] = c.all_gather_object({"rank": r})
    mesh = c.mesh({"dp_shard": w})
    out["mesh"] = {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}
    try:
        c.mesh({"dp_shard": w, "tp": 2})
        out["mesh_error"] = "no error"
    except CollectiveError as exc:
        out["mesh_error"] = str(exc)
    return out
