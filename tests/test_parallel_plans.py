"""Parallel plans belong to the model: a plugin MLP with its own TP plan (tp=2 matches tp=1 within 1e-4), a
model without plans (FSDP2/DDP train it; tp/pp/AC/compile are one-line errors naming its class), the loss
passed into the parallel model (also under pp), the micro-batch helpers, and frozen models.

The 2-rank cases share one call on the session's 2 real gloo ranks (tests/shared_ranks.py); each is compared
with the 1-process run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import shared_ranks
import torch
from one_line import raises_one_line
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from crosstrain import hookimpl, kernels
from crosstrain.errors import ConfigError
from crosstrain.models.gpt import GPT, build_gpt
from crosstrain.parallel import (
    ParallelDims,
    build_mesh,
    dp_rank_and_size,
    next_token_loss,
    parallelize,
    register_parallel_plan,
)
from crosstrain.parallel.plan import find_plan, tp_plans

STEPS = 5
BATCH = 4
SEQ = 16
REL = 1e-4


# -- a test plugin: every block's MLP becomes its own module, with its own attribute names and TP plan ---------
class GatedMLP(nn.Module):
    """SwiGLU with other names (``gate``/``up``/``down``) and hidden size than the GPT's FeedForward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(kernels.swiglu(self.gate(x), self.up(x)))


def gated_mlp_plan(mlp: GatedMLP) -> dict[str, Any]:
    return {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


# as a plugin does at import: GatedMLP is "third-party", so its plan is registered for the class
register_parallel_plan(GatedMLP, gated_mlp_plan)


class MLPPlugin:
    @hookimpl
    def crosstrain_transform_model(self, model: nn.Module, config: Any) -> nn.Module:
        torch.manual_seed(1)
        for block in model.blocks():
            block.feed_forward = GatedMLP(model.config.dim, 128)
        return model


class TinyLM(nn.Module):
    """A user model without any parallel plan."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 256))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.emb(tokens))


def z_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss plus a small z-loss, so a custom loss_fn visibly changes the training."""
    return next_token_loss(logits, targets) + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "plain":
        return TinyLM()
    model = build_gpt("tiny")
    return MLPPlugin().crosstrain_transform_model(model, None) if kind == "plugin" else model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 256, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _train(pm: Any, dp_rank: int, dp_size: int, accum: int = 1, manual: bool = False) -> dict[str, Any]:
    """AdamW steps through ``forward_backward``, or (``manual``) through ``micro_batch`` + the loss reduce."""
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3, weight_decay=0.1)
    per = BATCH // dp_size
    micro = per // accum
    losses = []
    for x, y in _batches():
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        step = 0.0
        for m in range(accum):
            pm.set_gradient_sync(m == accum - 1)
            xm, ym = xs[m * micro:(m + 1) * micro], ys[m * micro:(m + 1) * micro]
            if manual:
                with pm.micro_batch():
                    loss = pm.loss_fn(pm.module(xm), ym)
                    handle = pm.start_loss_reduce(loss)
                    (loss * (1.0 / accum)).backward()
                mean = pm.finish_loss_reduce(handle)
            else:
                mean, _ = pm.forward_backward(xm, ym, divisor=accum)
            step += mean.item() / accum
        pm.clip_grad_norm_(1.0)
        opt.step()
        losses.append(step)
    state = pm.full_state_dict()
    return {"losses": losses, "state": {k: v.numpy() for k, v in state.items()}}


def _frozen(dims: ParallelDims, mesh: Any) -> dict[str, Any]:
    pm = parallelize(_model("gpt"), dims, mesh, torch.device("cpu"), trainable=False)
    pm.train()  # a frozen model stays in eval mode
    x, y = _batches()[0]
    with torch.no_grad():
        logits = pm.module(x)
    return {"logits": logits.numpy(), "eval": pm.eval_loss(x, y).item(), "ddp": pm.use_ddp,
            "frozen": not any(p.requires_grad for p in pm.parameters()) and not pm.module.training}


def _worker(collective: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    def setup(**dims_kw: int) -> tuple[ParallelDims, Any, int, int]:
        dims = ParallelDims(world_size=collective.world_size, **dims_kw).resolve()
        mesh = build_mesh(collective, dims)
        return (dims, mesh, *dp_rank_and_size(mesh, dims))

    out: dict[str, Any] = {}
    cpu = torch.device("cpu")
    dims, mesh, r, n = setup(dp_shard=1, tp=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(_model("plugin"), dims, mesh, cpu)
    mlp = pm.module.layers["0"].feed_forward
    out["plugin_sharded"] = (isinstance(mlp.up.weight, DTensor) and mlp.up.weight.placements == (Shard(0),)
                             and mlp.down.weight.placements == (Shard(1),))
    out["plan_warnings"] = [str(w.message) for w in caught if "Parallelize plan key" in str(w.message)]
    out["plugin_tp"] = _train(pm, r, n)

    dims, mesh, r, n = setup(dp_shard=2)
    out["plain_fsdp"] = _train(parallelize(_model("plain"), dims, mesh, cpu), r, n)
    out["fsdp_manual"] = _train(parallelize(_model("gpt"), dims, mesh, cpu), r, n, accum=2, manual=True)
    out["fsdp_auto"] = _train(parallelize(_model("gpt"), dims, mesh, cpu), r, n, accum=2)
    out["frozen_fsdp"] = _frozen(dims, mesh)

    dims, mesh, r, n = setup(dp_replicate=2, dp_shard=1)
    out["plain_ddp"] = _train(parallelize(_model("plain"), dims, mesh, cpu), r, n)
    out["ddp_manual"] = _train(parallelize(_model("gpt"), dims, mesh, cpu), r, n, accum=2, manual=True)
    out["ddp_auto"] = _train(parallelize(_model("gpt"), dims, mesh, cpu), r, n, accum=2)
    out["frozen_replica"] = _frozen(dims, mesh)

    dims, mesh, r, n = setup(dp_shard=1, tp=2)
    out["frozen_tp"] = _frozen(dims, mesh)
    dims, mesh, r, n = setup(dp_shard=1, pp=2)
    pm = parallelize(_model("gpt"), dims, mesh, cpu, loss_fn=z_loss, pp_schedule="gpipe", pp_microbatches=2)
    out["pp_z_loss"] = _train(pm, r, n)
    return out


def _single(kind: str, **kwargs: Any) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pm = parallelize(_model(kind), ParallelDims(world_size=1).resolve(), None, torch.device("cpu"), **kwargs)
        return _train(pm, 0, 1)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return shared_ranks.run(_worker, timeout=500)


def _close(got: dict[str, Any], want: dict[str, Any], rel: float = REL) -> None:
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=rel), f"step {step}: loss {a} != single-process {b}"
    assert sorted(got["state"]) == sorted(want["state"])
    for name, value in want["state"].items():
        torch.testing.assert_close(torch.from_numpy(got["state"][name]), torch.from_numpy(value), rtol=rel, atol=rel,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_plugin_mlp_with_its_own_plan_tp2_matches_tp1(ranks):
    assert all(r["plugin_sharded"] for r in ranks), "the plugin's MLP was not sharded by its registered plan"
    assert ranks[0]["plan_warnings"] == []  # the block has no plan naming the replaced child
    _close(ranks[0]["plugin_tp"], _single("plugin"))
    assert ranks[0]["plugin_tp"]["losses"] == ranks[1]["plugin_tp"]["losses"]


@pytest.mark.parametrize("layout", ["plain_fsdp", "plain_ddp"])
def test_model_without_plans_trains_with_data_parallel(layout, ranks):
    _close(ranks[0][layout], _single("plain"), rel=1e-5)


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_micro_batch_helpers_compute_what_forward_backward_does(layout, ranks):
    manual, auto = ranks[0][f"{layout}_manual"], ranks[0][f"{layout}_auto"]
    assert manual["losses"] == auto["losses"]
    assert all((manual["state"][k] == v).all() for k, v in auto["state"].items())


def test_loss_fn_goes_into_the_pipeline_schedule(ranks):
    want = _single("gpt", loss_fn=z_loss)
    _close(ranks[0]["pp_z_loss"], want)
    assert not math.isclose(want["losses"][0], _single("gpt")["losses"][0], rel_tol=1e-3)  # the loss_fn matters


@pytest.mark.parametrize("layout,tol", [("frozen_fsdp", 1e-6), ("frozen_replica", 1e-6), ("frozen_tp", 1e-5)])
def test_frozen_model_forward_matches_unsharded(layout, tol, ranks):
    x, y = _batches()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        with torch.no_grad():
            want = _model("gpt").eval()(x)
    finally:
        torch.set_num_threads(threads)
    for r in ranks:
        got = r[layout]
        assert got["frozen"] and not got["ddp"]
        torch.testing.assert_close(torch.from_numpy(got["logits"]), want, rtol=0, atol=tol)
        assert got["eval"] == pytest.approx(next_token_loss(want, y).item(), rel=1e-5)


# -- single process ------------------------------------------------------------------------------------------
def test_layouts_without_a_plan_are_one_line_errors_naming_the_class():
    cpu = torch.device("cpu")

    def run(tp: int = 1, pp: int = 1, **kwargs: Any) -> Any:
        return parallelize(TinyLM(), ParallelDims(tp=tp, pp=pp, world_size=tp * pp).resolve(), None, cpu, **kwargs)

    raises_one_line(lambda: run(tp=2), "parallel.tp=2 needs a tensor-parallel plan", "model class TinyLM",
                    "TinyLM.tp_plan()", "crosstrain.parallel.register_parallel_plan(TinyLM, ...)", "parallel.tp=1")
    raises_one_line(lambda: run(pp=2), "parallel.pp=2", "TinyLM.pipeline_split(pp, stage)", "parallel.pp=1")
    raises_one_line(lambda: run(activation_checkpoint="every:2"), "'every:2'", "TinyLM.ac_units()")
    raises_one_line(lambda: run(compile="aot_eager"), "parallel.compile", "TinyLM", "parallel.compile=false")
    raises_one_line(lambda: parallelize(build_gpt("tiny"), ParallelDims(pp=2, world_size=2).resolve(), None, cpu,
                                        trainable=False), "frozen", "parallel.pp=1")


def test_plans_are_found_on_the_class_or_in_the_registry():
    class Base(nn.Module):
        def tp_plan(self) -> dict[str, Any]:
            return {"own": None}

    class Child(Base):
        pass

    class GrandChild(Child):
        def tp_plan(self) -> dict[str, Any]:
            return {"grandchild": None}

    assert find_plan(Child(), "tp_plan")() == {"own": None}
    register_parallel_plan(Child, lambda m: {"registered": type(m).__name__})
    assert find_plan(Child(), "tp_plan")() == {"registered": "Child"}  # a registration overrides the method
    assert find_plan(GrandChild(), "tp_plan")() == {"grandchild": None}  # the most derived class wins
    assert find_plan(Child(), "ac_units") is None

    class OptOut(Base):
        tp_plan = None

    assert find_plan(OptOut(), "tp_plan") is None
    with pytest.raises(ConfigError):
        register_parallel_plan(Base)


def test_gpt_plans_cover_each_module_once():
    model = build_gpt("tiny")
    owners = [type(m).__name__ for m, _ in tp_plans(model)]
    assert owners == ["GPT", "Attention", "FeedForward", "Attention", "FeedForward"]
    assert model.ac_units() == {"layers.0": 0, "layers.1": 1}
    model.pipeline_split(2, 1)
    assert model.ac_units() == {"layers.1": 1} and list(model.tp_plan()) == ["output"]
    assert isinstance(model, GPT)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_micro_batch_matches_forward_backward_single_process(precision):
    x, y = _batches()[0]
    cpu, dims = torch.device("cpu"), ParallelDims(world_size=1).resolve()
    auto = parallelize(_model("gpt"), dims, None, cpu, precision=precision)
    manual = parallelize(_model("gpt"), dims, None, cpu, precision=precision)
    want, _ = auto.forward_backward(x, y, scale=2.0, divisor=4)
    with manual.micro_batch():
        loss = manual.loss_fn(manual.module(x), y)
        handle = manual.start_loss_reduce(loss)
        (loss * (2.0 / 4)).backward()
    assert torch.equal(manual.finish_loss_reduce(handle), want)
    for (name, p), (_, q) in zip(auto.named_parameters(), manual.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_frozen_single_process():
    x, y = _batches()[0]
    pm = parallelize(_model("gpt"), ParallelDims(world_size=1).resolve(), None, torch.device("cpu"), trainable=False)
    assert not any(p.requires_grad for p in pm.parameters()) and not pm.train().module.training
    with torch.no_grad():
        torch.testing.assert_close(pm.module(x), _model("gpt")(x), rtol=0, atol=0)
    raises_one_line(lambda: pm.forward_backward(x, y), "frozen", "trainable=True")
