"""Every parallel layout trains the tiny GPT exactly like one process: real gloo processes, 8 fp32 AdamW steps
on fixed data, per-step losses and gradient norms within 1e-4 relative, and the same full state at the end.

The 2-rank layouts run in sequence on the session's shared 2 ranks (tests/shared_ranks.py), the 4-rank ones on
one spawn (process start-up dominates on 2 cores).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest
import shared_ranks
import torch

from crosstrain.testing.multiprocess import run_ranks

STEPS = 8
BATCH = 4
SEQ = 16
LR = 3e-3
CLIP = 1.0  # the tiny GPT's gradient norm starts near 8, so clipping is active and tested
REL = 1e-4

# name -> (dims, parallelize kwargs, gradient-accumulation micro-steps)
LAYOUTS_2: dict[str, tuple[dict, dict, int]] = {
    "ddp": ({"dp_replicate": 2, "dp_shard": 1}, {}, 1),
    "ddp_accum_ac": ({"dp_replicate": 2, "dp_shard": 1}, {"activation_checkpoint": "full"}, 2),
    "fsdp": ({"dp_shard": 2}, {}, 1),
    "fsdp_accum_ac": ({"dp_shard": 2}, {"activation_checkpoint": "every:2"}, 2),
    "fsdp_compile_ac": ({"dp_shard": 2}, {"compile": "aot_eager", "activation_checkpoint": "every:2"}, 1),
    "tp": ({"dp_shard": 1, "tp": 2}, {}, 1),
    "pp_gpipe": ({"dp_shard": 1, "pp": 2}, {"pp_schedule": "gpipe", "pp_microbatches": 2}, 1),
    "pp_1f1b_accum": ({"dp_shard": 1, "pp": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}, 2),
}
# tied input/output embeddings: one vocab-sharded DTensor serves both (checked against a tied reference)
TIED_2: dict[str, tuple[dict, dict, int]] = {
    "tp_tied": ({"dp_shard": 1, "tp": 2}, {"tie_embeddings": True}, 1),
}
# low precision: the same run in bf16 (autocast, or FSDP's MixedPrecisionPolicy) and fp16 with a loss scale
MIXED_2: dict[str, tuple[dict, dict, int]] = {
    "fsdp_bf16": ({"dp_shard": 2}, {"precision": "bf16"}, 1),
    "tp_bf16": ({"dp_shard": 1, "tp": 2}, {"precision": "bf16"}, 1),
    "pp_bf16": ({"dp_shard": 1, "pp": 2}, {"precision": "bf16", "pp_microbatches": 2}, 1),
    "ddp_fp16_scaled": ({"dp_replicate": 2, "dp_shard": 1}, {"precision": "fp16", "loss_scale": 1024.0}, 1),
    "fsdp_fp16_scaled": ({"dp_shard": 2}, {"precision": "fp16", "loss_scale": 1024.0}, 2),
}
MIXED_REL = 3e-2
LAYOUTS_4: dict[str, tuple[dict, dict, int]] = {
    "fsdp_x_tp": ({"dp_shard": 2, "tp": 2}, {}, 1),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, {}, 1),
    "ddp_x_tp": ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, {}, 1),
    "pp_x_fsdp": ({"dp_shard": 2, "pp": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}, 1),
    "pp_x_tp": ({"dp_shard": 1, "tp": 2, "pp": 2}, {"pp_schedule": "gpipe", "pp_microbatches": 2}, 1),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _model(tie: bool = False) -> torch.nn.Module:
    from crosstrain.models.gpt import build_gpt

    torch.manual_seed(0)
    return build_gpt("tiny", tie_embeddings=tie)


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def _train_layout(collective: Any, dims_kw: dict, kwargs: dict, accum: int) -> dict[str, Any]:
    from crosstrain.parallel import ParallelDims, build_mesh, dp_rank_and_size, parallelize

    kwargs = dict(kwargs)
    scale = kwargs.pop("loss_scale", 1.0)
    tie = kwargs.pop("tie_embeddings", False)
    kwargs.setdefault("precision", "fp32")
    dims = ParallelDims(world_size=collective.world_size, **dims_kw).resolve()
    mesh = build_mesh(collective, dims)
    pm = parallelize(_model(tie), dims, mesh, torch.device("cpu"), **kwargs)
    master_fp32 = all(p.dtype == torch.float32 for p in pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.1)
    dp_rank, dp_size = dp_rank_and_size(mesh, dims)
    per = BATCH // dp_size
    losses, norms = [], []
    for x, y in _batches():
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        micro = per // accum
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for m in range(accum):
            pm.set_gradient_sync(m == accum - 1)
            loss, timings = pm.forward_backward(xs[m * micro:(m + 1) * micro], ys[m * micro:(m + 1) * micro],
                                                scale=scale, divisor=accum)
            assert set(timings) >= {"forward_s", "backward_s", "comm_s"}
            step_loss += loss.item() / accum
        if scale != 1.0:  # what the trainer's loss scaler does before clipping
            for p in pm.parameters():
                p.grad.div_(scale)
        norms.append(pm.clip_grad_norm_(CLIP).item())
        opt.step()
        losses.append(step_loss)
    x0, y0 = _batches()[0]
    eval_loss = pm.eval_loss(x0[dp_rank * per:(dp_rank + 1) * per], y0[dp_rank * per:(dp_rank + 1) * per]).item()
    state = pm.full_state_dict()
    # numpy arrays travel by value (torch tensors would go through shared memory that dies with the worker)
    return {"losses": losses, "norms": norms, "digest": _digest(state), "master_fp32": master_fp32, "eval": eval_loss,
            "state": {k: v.numpy() for k, v in state.items()} if collective.rank == 0 else None}


def _run_all(collective: Any, layouts: dict[str, tuple[dict, dict, int]]) -> dict[str, Any]:
    return {name: _train_layout(collective, *spec) for name, spec in layouts.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference(tie=False)


@pytest.fixture(scope="module")
def reference_tied() -> dict[str, Any]:
    return _reference(tie=True)


def _reference(tie: bool) -> dict[str, Any]:
    """The single-process run: a plain PyTorch loop, no crosstrain.parallel involved."""
    from crosstrain import kernels

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(tie)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        losses, norms = [], []
        for x, y in _batches():
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            loss = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            x0, y0 = _batches()[0]
            logits = model(x0)
            eval_loss = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), y0.reshape(-1)).item()
    finally:
        torch.set_num_threads(threads)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state, "eval": eval_loss}


@pytest.fixture(scope="module")
def results2() -> dict[str, Any]:
    return _merge(shared_ranks.run(_run_all, {**LAYOUTS_2, **MIXED_2, **TIED_2}, timeout=500))


@pytest.fixture(scope="module")
def results4() -> dict[str, Any]:
    return _merge(run_ranks(_run_all, 4, LAYOUTS_4, timeout=500))


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    merged = {}
    for name, first in per_rank[0].items():
        merged[name] = dict(first, digests=[r[name]["digest"] for r in per_rank],
                            all_losses=[r[name]["losses"] for r in per_rank])
    return merged


def _check(result: dict[str, Any], reference: dict[str, Any]) -> None:
    assert result["master_fp32"]
    assert reference["losses"] and reference["norms"], "the single-process reference recorded no steps"
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert math.isclose(got, want, rel_tol=REL), f"step {step}: loss {got} != single-process {want}"
    for step, (got, want) in enumerate(zip(result["norms"], reference["norms"], strict=True)):
        assert math.isclose(got, want, rel_tol=REL), f"step {step}: grad norm {got} != single-process {want}"
    assert math.isclose(result["eval"], reference["eval"], rel_tol=REL), "eval_loss after training"
    # every rank reports the same loss and holds the same full state
    assert all(losses == result["losses"] for losses in result["all_losses"])
    assert len(set(result["digests"])) == 1, "full_state_dict differs between ranks"
    state, want = {k: torch.from_numpy(v) for k, v in result["state"].items()}, reference["state"]
    assert sorted(state) == sorted(want)
    for name, tensor in want.items():
        assert state[name].dtype == torch.float32 and state[name].device.type == "cpu"
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=2e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_reference_learns(reference):
    assert len(reference["losses"]) == STEPS
    assert reference["norms"][0] > CLIP  # clipping is exercised


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_two_rank_layout_matches_single_process(layout, results2, reference):
    _check(results2[layout], reference)


@pytest.mark.parametrize("layout", list(TIED_2))
def test_tied_embedding_layout_matches_single_process(layout, results2, reference_tied):
    _check(results2[layout], reference_tied)
    assert torch.equal(torch.from_numpy(results2[layout]["state"]["output.weight"]),
                       torch.from_numpy(results2[layout]["state"]["tok_embeddings.weight"]))


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_four_rank_layout_matches_single_process(layout, results4, reference):
    _check(results4[layout], reference)


@pytest.mark.parametrize("layout", list(MIXED_2))
def test_low_precision_layout_tracks_fp32(layout, results2, reference):
    result = results2[layout]
    assert result["master_fp32"], "parameters (the optimizer's master weights) must stay fp32"
    assert reference["losses"], "the single-process reference recorded no steps"
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert math.isfinite(got) and math.isclose(got, want, rel_tol=MIXED_REL), f"step {step}: {got} vs {want}"
    assert all(losses == result["losses"] for losses in result["all_losses"])
    assert len(set(result["digests"])) == 1
    # low precision changes the numbers: the final weights differ from fp32 but stay close
    diff = max((torch.from_numpy(v) - reference["state"][k]).abs().max().item() for k, v in result["state"].items())
    assert 0 < diff < 0.05
