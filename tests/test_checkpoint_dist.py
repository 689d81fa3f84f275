"""Checkpoints across ranks (real gloo processes): FSDP on 2 ranks saves; 1 rank and tp=2 load and continue with
the same losses (within 1e-5); a background save failing on one rank raises on every rank."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch

from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal, RNGState
from crosstrain.checkpoint.manager import CheckpointManager

BATCH, SEQ, LR = 4, 16, 3e-3
BEFORE, AFTER = 3, 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(BEFORE + AFTER):
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _parallel(collective: Any, seed: int, **dims_kw: int) -> tuple[Any, Any, Any, Any]:
    from crosstrain.models.gpt import build_gpt
    from crosstrain.parallel import ParallelDims, build_mesh, dp_rank_and_size, parallelize

    torch.manual_seed(seed)
    dims = ParallelDims(world_size=collective.world_size, **dims_kw).resolve()
    mesh = build_mesh(collective, dims)
    pm = parallelize(build_gpt("tiny"), dims, mesh, torch.device("cpu"), precision="fp32")
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.1)
    return pm, opt, mesh, dp_rank_and_size(mesh, dims)


def _steps(pm: Any, opt: Any, dp: tuple[int, int], batches: list) -> list[float]:
    dp_rank, dp_size = dp
    per = BATCH // dp_size
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss, _ = pm.forward_backward(x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per])
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _failing_writer(rank: int) -> Any:
    """Fault injection at the storage boundary: rank ``rank``'s shard file cannot be created (disk full)."""
    from crosstrain.checkpoint.safe_io import HashingFileSystem, HashingFileSystemWriter

    class FailingFS(HashingFileSystem):
        def create_stream(self, path: Any, mode: str) -> Any:
            if "w" in mode and str(path).endswith(".distcp") and f"__{rank}_" in str(path):
                raise OSError(28, "No space left on device (injected)")
            return super().create_stream(path, mode)

    class FailingWriter(HashingFileSystemWriter):
        def __init__(self, path: Any, **kwargs: Any) -> None:
            super().__init__(path, **kwargs)
            self.fs = FailingFS()

    return FailingWriter


def _fsdp_save(collective: Any, folder: str) -> dict[str, Any]:
    from crosstrain.errors import CheckpointError

    pm, opt, _, dp = _parallel(collective, seed=0, dp_shard=2)
    batches = _batches()
    _steps(pm, opt, dp, batches[:BEFORE])
    mgr = CheckpointManager(folder, async_save=True)
    mgr.save(BEFORE, {"app": ModelOptimizerState(pm.module, opt), "rng": RankLocal(RNGState()),
                      "meta": {"note": "fsdp"}})
    after = _steps(pm, opt, dp, batches[BEFORE:])  # trains while the save is written
    mgr.wait()
    # a background failure on rank 1 surfaces on both ranks, and the good checkpoint stays latest
    mgr._checkpointer.writer_factory = _failing_writer(1)
    mgr.save(BEFORE + AFTER, {"app": ModelOptimizerState(pm.module, opt)})
    raised = None
    try:  # "training steps": every rank calls check_background at the same points, as the trainer does
        for _ in range(100):
            mgr.check_background()
            time.sleep(0.02)
        mgr.wait()
    except CheckpointError as exc:
        raised = str(exc)
    # staging on the background thread (stage_later) fails on rank 1 only: both ranks raise, nobody hangs
    mgr._checkpointer.writer_factory = type(mgr._checkpointer).writer_factory
    stage = mgr._stager.stage

    def lost_buffer(tensors: dict) -> dict:
        if collective.rank == 1 and threading.current_thread() is not threading.main_thread():
            raise OSError("host staging buffer lost (injected)")
        return stage(tensors)

    mgr._stager.stage = lost_buffer
    mgr.save(BEFORE + AFTER + 1, {"app": ModelOptimizerState(pm.module, opt)}, stage_later=("app",))
    mgr.fence()
    staging_raised = None
    try:  # as the trainer: start the agreement at the end of a step, finish it in the next
        for _ in range(100):
            mgr.start_check()
            time.sleep(0.02)
            mgr.check_background()
        mgr.wait()
    except CheckpointError as exc:
        staging_raised = str(exc)
    info = mgr.latest()
    mgr._stager.stage = stage
    # a newer checkpoint with one flipped byte: the ranks split the hashing and both skip it
    mgr.save(BEFORE + AFTER + 2, {"app": ModelOptimizerState(pm.module, opt)})
    mgr.wait()
    newest = Path(folder) / f"step_{BEFORE + AFTER + 2}"
    torch.distributed.barrier()
    if collective.rank == 0:
        for shard in newest.glob("*.distcp"):
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
            break
    torch.distributed.barrier()
    with pytest.warns(UserWarning, match="fails its SHA-256 check"):
        together = mgr.latest_together()
    if collective.rank == 0:
        shutil.rmtree(newest)
    mgr.close()
    # the same two ranks now load that checkpoint into a tp=2 layout (one call: start-up dominates here)
    return {"after": after, "raised": raised, "staging_raised": staging_raised, "latest": info.step if info else None,
            "together": together.step if together else None,
            "tp_after": _tp_load(collective, folder)}


def _tp_load(collective: Any, folder: str) -> list[float]:
    pm, opt, _, dp = _parallel(collective, seed=1, dp_shard=1, tp=2)
    mgr = CheckpointManager(folder)
    meta: dict = {}
    # by path: the ranks split the SHA-256 verification before loading
    state = {"app": ModelOptimizerState(pm.module, opt), "meta": meta}
    assert mgr.load(Path(folder) / f"step_{BEFORE}", state) == BEFORE
    assert meta == {"note": "fsdp"}
    mgr.close()
    return _steps(pm, opt, dp, _batches()[BEFORE:])


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("dist") / "checkpoints"
    return folder, shared_ranks.run(_fsdp_save, str(folder), timeout=300)


def test_async_failure_on_one_rank_raises_on_every_rank(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp_run
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} did not see the failed background save"
        assert "step 6" in r["raised"]
        assert r["latest"] == BEFORE and r["together"] == BEFORE
    for r in results:  # both ranks name rank 1 and its error
        assert "rank 1" in r["raised"] and "no space left on device" in r["raised"].lower(), r["raised"]
        assert r["staging_raised"] is not None and "step 7" in r["staging_raised"]
        assert "rank 1 while preparing" in r["staging_raised"] and "buffer lost" in r["staging_raised"]


def test_fsdp_checkpoint_loads_on_one_rank(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    from crosstrain.models.gpt import build_gpt

    folder, results = fsdp_run
    reference = results[0]["after"]
    torch.manual_seed(7)
    model = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    mgr = CheckpointManager(folder)
    with pytest.warns(UserWarning, match="saved by 2 ranks"):
        step = mgr.load(mgr.latest(), {"app": ModelOptimizerState(model, opt), "rng": RankLocal(RNGState())})
    assert step == BEFORE
    from crosstrain import kernels

    losses = []
    for x, y in _batches()[BEFORE:]:
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses == pytest.approx(reference, abs=1e-5)


def test_fsdp_checkpoint_loads_with_tp2(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp_run
    for r in results:
        assert r["tp_after"] == pytest.approx(results[0]["after"], abs=1e-5)
