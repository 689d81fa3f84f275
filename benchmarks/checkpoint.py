"""Checkpoint save/load throughput on 2 ranks, side by side, plus async stall and kill-to-resume recovery time.

Each rank holds half of a ``--size-gb`` state of FSDP-style sharded DTensors (Shard(0) over a 2-rank mesh).
Methods, each timed from a barrier to a barrier (wall time of the slowest rank):

- raw       every rank writes its shard bytes to one file sequentially, then fsync (the storage ceiling);
            also timed asking the kernel to start writing back as it goes (sync_file_range, as crosstrain's
            writer does), reported as ``save_vs_raw_writeback``: the stricter ceiling
- crosstrain  CheckpointManager.save: DCP + SHA-256 manifest + atomic commit (fsync'd)
- dcp       torch.distributed.checkpoint.save with its defaults (FileSystemWriter, fsync on)
- torch.save  every rank torch.save()s its local shards, then fsync (so it is as durable as the others)

Page cache: dirty pages are flushed before each timed save (os.sync) and every method fsyncs its files, so
saves are timed to durable storage; before each timed load the files are evicted from the page cache with
posix_fadvise(DONTNEED) so loads read from storage (crosstrain's load includes verifying every SHA-256).

Async: a simulated training loop (see ``_stall``) saves once in steady state (host buffers reused). The stall
is the time the loop spends blocked in checkpoint calls until that save is committed, relative to a
synchronous crosstrain save of the same state; ``async_stall_inline_fraction`` is the same with all staging
done inside ``save()``; ``async_slowdown_fraction`` is the loop's extra wall time, which on a CPU-only machine
also counts the background writer competing with the training threads for the cores.
Recovery: a tiny-model ``crosstrain train`` run is SIGKILLed after its first checkpoint; the time from the
kill to the first step completed by a restarted run (``checkpoint.resume=auto``) is reported.

Last line: JSON ``{"save_vs_raw", "save_vs_dcp", "async_stall_fraction", "recovery_s", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROW = 4096  # fp32 columns per row: 16 KiB rows


def _evict(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _bench_ranks(collective: Any, size_gb: float, workdir: str, repeats: int, step_s: float) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from crosstrain.checkpoint.manager import CheckpointManager
    from crosstrain.checkpoint.safe_io import start_writeback

    rank, world = collective.rank, collective.world_size
    mesh = collective.mesh({"dp_shard": world})
    n_tensors = 16
    rows = max(world, int(size_gb * 2**30 / 4 / ROW / n_tensors) // world * world)
    g = torch.Generator().manual_seed(rank)
    state = {f"layer{i}.weight": DTensor.from_local(torch.randn(rows // world, ROW, generator=g), mesh, [Shard(0)],
                                                    run_check=False)
             for i in range(n_tensors)}
    local_bytes = sum(t.to_local().numel() * 4 for t in state.values())
    total_bytes = local_bytes * world
    base = Path(workdir)

    def timed(fn: Any) -> float:
        os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def best(fn: Any, before: Any = None) -> float:
        times = []
        for i in range(repeats):
            if before is not None:
                before(i)
            times.append(timed(lambda i=i: fn(i)))
        return min(times)

    def clean(path: Path) -> None:
        dist.barrier()
        if rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()

    out: dict[str, Any] = {"bytes": total_bytes}

    # raw sequential write + fsync of the same bytes
    raw_dir = base / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)

    def raw_save(i: int) -> None:
        with open(raw_dir / f"rank{rank}.bin", "wb", buffering=0) as fh:
            for t in state.values():
                fh.write(memoryview(t.to_local().numpy()).cast("B"))
            os.fsync(fh.fileno())

    out["raw_save_s"] = best(raw_save)

    def raw_writeback_save(i: int) -> None:  # the same, asking the kernel to write back as it goes
        with open(raw_dir / f"rank{rank}.bin", "wb", buffering=0) as fh:
            done = 0
            for t in state.values():
                done += fh.write(memoryview(t.to_local().numpy()).cast("B"))
                if start_writeback is not None:
                    start_writeback(fh.fileno(), 0, done)
            os.fsync(fh.fileno())

    out["raw_writeback_save_s"] = best(raw_writeback_save)

    def raw_load(i: int) -> None:
        with open(raw_dir / f"rank{rank}.bin", "rb", buffering=0) as fh:
            for t in state.values():
                buf = torch.empty_like(t.to_local())
                fh.readinto(memoryview(buf.numpy()).cast("B"))

    out["raw_load_s"] = best(raw_load, before=lambda i: _evict(raw_dir))

    # crosstrain (sync)
    ck_dir = base / "crosstrain"
    mgr = CheckpointManager(ck_dir, keep_last=repeats)  # no deletions (background) during the timed saves
    out["crosstrain_save_s"] = best(lambda i: mgr.save(i + 1, {"model": state}))
    target = {k: DTensor.from_local(torch.empty_like(v.to_local()), mesh,
                                                                                 [Shard(0)], run_check=False)
              for k, v in state.items()}
    info = mgr.latest()
    assert info is not None
    out["crosstrain_load_s"] = best(lambda i: mgr.load(info.path, {"model": target}),
                                    before=lambda i: _evict(info.path))
    for k in state:
        assert torch.equal(target[k].to_local(), state[k].to_local()), "crosstrain load mismatch"
    # async: what a training loop loses (see _stall)
    amgr = CheckpointManager(base / "async", keep_last=1, async_save=True)
    out.update(_stall(amgr, state, step_s))
    amgr.close()
    mgr.close()
    clean(ck_dir)
    clean(base / "async")

    # plain DCP defaults
    dcp_dir = base / "dcp"

    def dcp_save(i: int) -> None:
        dcp.save(state, checkpoint_id=str(dcp_dir / f"s{i}"))

    out["dcp_save_s"] = best(dcp_save)
    out["dcp_load_s"] = best(lambda i: dcp.load(target, checkpoint_id=str(dcp_dir / "s0")),
                             before=lambda i: _evict(dcp_dir / "s0"))
    clean(dcp_dir)

    # torch.save of the local shards, fsync'd
    ts_dir = base / "torch_save"
    ts_dir.mkdir(parents=True, exist_ok=True)
    local = {k: v.to_local() for k, v in state.items()}

    def ts_save(i: int) -> None:
        path = ts_dir / f"rank{rank}.pt"
        torch.save(local, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out["torch_save_s"] = best(ts_save)
    out["torch_load_s"] = best(lambda i: torch.load(ts_dir / f"rank{rank}.pt", weights_only=True),
                               before=lambda i: _evict(ts_dir))
    clean(raw_dir)
    clean(ts_dir)
    return out


def _stall(mgr: Any, state: dict[str, Any], step_s: float) -> dict[str, float]:
    """Run a simulated training loop around async saves and time what the loop loses.

    One step: "forward/backward" (matmuls for about ``step_s`` seconds that do not touch the state, then a
    gradient all-reduce as in data parallelism), then ``fence()`` and ``check_background()`` where the trainer
    calls them, then the "optimizer step" (an in-place update of every state tensor), then ``save()`` (first
    step) and ``start_check()``. The stall is the time spent blocked inside these calls
    from the save until it is committed; the slowdown is the loop's extra wall time over the same steps without
    a save (which also counts the background writer competing for this machine's CPU cores).
    """
    import torch.distributed as dist

    a, b, grads = torch.randn(256, 256), torch.randn(256, 256), torch.zeros(1 << 18)
    locals_ = [t.to_local() for t in state.values()]

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    t0 = time.perf_counter()
    matmuls(50)
    n_mm = max(1, int(step_s / ((time.perf_counter() - t0) / 50)))
    agreed = torch.tensor([n_mm])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    n_mm = int(agreed)

    def loop(save_step: int | None, stage_later: tuple[str, ...], min_steps: int) -> tuple[dict[str, float],
                                                                                          float, int]:
        blocked = {"save": 0.0, "fence": 0.0, "check": 0.0, "start_check": 0.0}
        steps = 0
        dist.barrier()
        start = time.perf_counter()
        in_flight = False
        while steps < min_steps or in_flight:
            matmuls(n_mm)
            dist.all_reduce(grads)
            t = time.perf_counter()
            mgr.fence()
            blocked["fence"] += time.perf_counter() - t
            t = time.perf_counter()
            in_flight = mgr.check_background()  # where the trainer calls it: after the gradient sync
            blocked["check"] += time.perf_counter() - t
            for x in locals_:
                x.mul_(0.5).add_(1.0)
            if save_step is not None and steps == 0:
                t = time.perf_counter()
                mgr.save(save_step, {"model": state}, stage_later=stage_later)
                blocked["save"] += time.perf_counter() - t
                in_flight = True
            t = time.perf_counter()
            mgr.start_check()  # the trainer starts the agreement at the end of each step
            blocked["start_check"] += time.perf_counter() - t
            steps += 1
        dist.barrier()
        return blocked, time.perf_counter() - start, steps

    loop(1, (), 1)  # first save: allocates the host buffers (reused afterwards)
    mgr.wait()
    inline, _, _ = loop(2, (), 2)
    deferred, wall, steps = loop(3, ("model",), 2)
    _, base_wall, base_steps = loop(None, (), steps)
    per_step = base_wall / base_steps
    out = {f"async_blocked_{k}_s": _slowest(v) for k, v in deferred.items()}
    out.update({"async_stall_s": _slowest(sum(deferred.values())),
                "async_stall_inline_s": _slowest(sum(inline.values())),
                "async_slowdown_s": _slowest(wall - per_step * steps), "loop_step_s": per_step,
                "async_steps": float(steps)})
    return out


def _slowest(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _recovery(workdir: Path, timeout: float = 300.0) -> float:
    """Seconds from SIGKILL of a tiny-model run to the first step finished by the restarted run."""
    run_dir = workdir / "recovery_run"
    cmd = [sys.executable, "-m", "crosstrain", "train", "--set", "train.steps=100000", "--set", "train.batch_size=4",
           "--set", "train.seq_len=32", "--set", "checkpoint.every=5", "--set", "logging.progress=none",
           "--set", "logging.tensorboard=false", "--run-dir", str(run_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout
    while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    metrics = run_dir / "metrics.jsonl"
    proc.send_signal(signal.SIGKILL)
    killed_at = time.perf_counter()
    proc.wait()
    lines_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) > lines_before:
                return time.perf_counter() - killed_at
            time.sleep(0.01)
        raise RuntimeError("the restarted run did not complete a step")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="total state size over both ranks (GiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per method (best is reported)")
    parser.add_argument("--step-s-per-gb", type=float, default=0.5,
                        help="compute time of one simulated training step around the async saves, per GB of state "
                             "(a step's FLOPs and a checkpoint's bytes both grow with the parameter count)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    parser.add_argument("--no-recovery", action="store_true", help="skip the kill-to-resume measurement")
    args = parser.parse_args()

    from crosstrain.testing.multiprocess import run_ranks

    workdir = Path(tempfile.mkdtemp(prefix="ckbench-", dir=args.dir))
    try:
        step_s = args.step_s_per_gb * args.size_gb * 2**30 / 1e9
        res = run_ranks(_bench_ranks, 2, args.size_gb, str(workdir), args.repeats, step_s, timeout=1800)[0]
        recovery = None if args.no_recovery else _recovery(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gb = res["bytes"] / 1e9
    print(f"state: {gb:.2f} GB over 2 ranks (fp32 Shard(0) DTensors), best of {args.repeats}")
    print(f"{'method':<12}{'save s':>9}{'save GB/s':>11}{'load s':>9}{'load GB/s':>11}")
    for name, s, lo in (("raw", "raw_save_s", "raw_load_s"), ("crosstrain", "crosstrain_save_s", "crosstrain_load_s"),
                        ("dcp", "dcp_save_s", "dcp_load_s"), ("torch.save", "torch_save_s", "torch_load_s")):
        print(f"{name:<12}{res[s]:>9.2f}{gb / res[s]:>11.3f}{res[lo]:>9.2f}{gb / res[lo]:>11.3f}")
    print(f"raw with early writeback (sync_file_range as it writes): {res['raw_writeback_save_s']:.2f} s")
    print(f"async save in a loop of {res['loop_step_s']:.2f} s steps ({res['async_steps']:.0f} steps until committed):"
          f" blocked {res['async_stall_s']:.3f} s staging during the step, {res['async_stall_inline_s']:.3f} s"
          f" staging inside save(); loop slowdown {res['async_slowdown_s']:.3f} s; sync save"
          f" {res['crosstrain_save_s']:.2f} s")
    parts = (f"{k}() {res[f'async_blocked_{k}_s']:.3f} s" for k in ("save", "fence", "check", "start_check"))
    print("  blocked in: " + ", ".join(parts))
    if recovery is not None:
        print(f"recovery (SIGKILL -> first resumed step, tiny model, new process): {recovery:.2f} s")
    summary = {
        "save_vs_raw": round(res["raw_save_s"] / res["crosstrain_save_s"], 3),
        "save_vs_raw_writeback": round(res["raw_writeback_save_s"] / res["crosstrain_save_s"], 3),
        "save_vs_dcp": round(res["dcp_save_s"] / res["crosstrain_save_s"], 3),
        "async_stall_fraction": round(res["async_stall_s"] / res["crosstrain_save_s"], 4),
        "async_stall_inline_fraction": round(res["async_stall_inline_s"] / res["crosstrain_save_s"], 4),
        "async_slowdown_fraction": round(res["async_slowdown_s"] / res["crosstrain_save_s"], 4),
        "recovery_s": round(recovery, 2) if recovery is not None else None,
        "load_vs_raw": round(res["raw_load_s"] / res["crosstrain_load_s"], 3),
        "load_vs_dcp": round(res["dcp_load_s"] / res["crosstrain_load_s"], 3),
        "save_vs_torch_save": round(res["torch_save_s"] / res["crosstrain_save_s"], 3),
        "state_gb": round(gb, 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
