"""Checkpoints across ranks (real gloo processes): FSDP on 2 ranks saves; 1 rank and tp=2 load and continue with
the same losses (within 1e-5); a background save failing on one rank raises on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal, RNGState
from crosstrain.checkpoint.manager import CheckpointManager
from crosstrain.testing.multiprocess import run_ranks

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


class _FailOnRank1:
    """Fault injection: a checkpointer whose write raises on rank 1 only."""

    def __init__(self, inner: Any, rank: int) -> None:
        self.inner, self.rank = inner, rank

    def prepare(self, *a: Any, **k: Any) -> Any:
        return self.inner.prepare(*a, **k)

    def write(self, *a: Any, **k: Any) -> Any:
        if self.rank == 1:
            raise OSError("disk full (injected)")
        return self.inner.write(*a, **k)

    def load_into(self, *a: Any, **k: Any) -> Any:
        return self.inner.load_into(*a, **k)


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
    mgr._checkpointer = _FailOnRank1(mgr._checkpointer, collective.rank)
    mgr.save(BEFORE + AFTER, {"app": ModelOptimizerState(pm.module, opt)})
    raised = None
    for _ in range(200):
        try:
            mgr.check_background()
        except CheckpointError as exc:
            raised = str(exc)
            break
        if not mgr.in_flight:
            try:
                mgr.wait()
            except CheckpointError as exc:
                raised = str(exc)
            break
    info = mgr.latest()
    mgr.close()
    return {"after": after, "raised": raised, "latest": info.step if info else None}


def _tp_load(collective: Any, folder: str) -> list[float]:
    pm, opt, _, dp = _parallel(collective, seed=1, dp_shard=1, tp=2)
    mgr = CheckpointManager(folder)
    meta: dict = {}
    assert mgr.load(mgr.latest(), {"app": ModelOptimizerState(pm.module, opt), "meta": meta}) == BEFORE
    assert meta == {"note": "fsdp"}
    mgr.close()
    return _steps(pm, opt, dp, _batches()[BEFORE:])


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("dist") / "checkpoints"
    return folder, run_ranks(_fsdp_save, 2, str(folder), timeout=300)


def test_async_failure_on_one_rank_raises_on_every_rank(fsdp_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp_run
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} did not see the failed background save"
        assert "step 6" in r["raised"]
        assert r["latest"] == BEFORE
    assert "disk full" in results[1]["raised"] and "another rank" in results[0]["raised"]


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
    folder, results = fsdp_run
    tp_losses = run_ranks(_tp_load, 2, str(folder), timeout=300)
    for losses in tp_losses:
        assert losses == pytest.approx(results[0]["after"], abs=1e-5)
