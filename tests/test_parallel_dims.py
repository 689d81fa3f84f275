"""ParallelDims checks (one-line ConfigErrors), stage split, activation checkpointing, compile and the
single-process ParallelModel against a plain GPT."""

from __future__ import annotations

import pytest
import torch
from one_line import raises_one_line

from crosstrain import kernels
from crosstrain.models.gpt import build_gpt
from crosstrain.parallel import ParallelDims, build_mesh, dp_rank_and_size, parallelize
from crosstrain.parallel.activation_checkpoint import parse_ac
from crosstrain.parallel.pp import split_stage, stage_layers
from crosstrain.parallel.state import clean_name


def test_resolve_fills_dp_shard():
    dims = ParallelDims(tp=2, pp=2, world_size=16).resolve()
    assert (dims.dp_shard, dims.dp_degree) == (4, 4)
    assert dims.mesh_shape() == {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "ep": 1, "tp": 2}
    assert ParallelDims(world_size=1).resolve().dp_degree == 1
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4).resolve()
    assert hsdp.dp_degree == 4 and hsdp.fsdp_enabled and not hsdp.tp_enabled


def test_product_must_equal_world_size():
    raises_one_line(lambda: ParallelDims(dp_shard=2, tp=2, world_size=2).resolve(),
                    "parallel.dp_shard=2", "parallel.tp=2", "world size is 2")
    raises_one_line(lambda: ParallelDims(tp=3, world_size=4).resolve(), "parallel.tp=3", "world size 4")
    raises_one_line(lambda: ParallelDims(dp_replicate=2, dp_shard=1, world_size=4).resolve(), "parallel.dp_replicate")


def test_bad_values():
    raises_one_line(lambda: ParallelDims(ep=0, world_size=2).resolve(), "parallel.ep=0")
    raises_one_line(lambda: ParallelDims(tp=0, world_size=2).resolve(), "parallel.tp=0")
    raises_one_line(lambda: ParallelDims(dp_shard=0, world_size=2).resolve(), "parallel.dp_shard=0")
    raises_one_line(lambda: ParallelDims(pp=-2, world_size=2).resolve(), "parallel.pp=-2")


def test_parse_activation_checkpoint():
    assert parse_ac("none") == 0 and parse_ac("full") == 1 and parse_ac("every:3") == 3
    for bad in ("every:0", "every:x", "sometimes"):
        raises_one_line(lambda b=bad: parse_ac(b), "none, full or every:N")


def test_stage_split_covers_every_layer_once():
    for n_layers, pp in [(2, 2), (5, 2), (7, 3), (4, 4)]:
        owned = [stage_layers(n_layers, pp, s) for s in range(pp)]
        assert sum(owned, []) == list(range(n_layers))
        assert max(map(len, owned)) - min(map(len, owned)) <= 1
    model = split_stage(build_gpt("tiny", n_layers=5), 2, 1)
    assert list(model.layers.keys()) == ["3", "4"] and model.tok_embeddings is None and model.output is not None
    first = split_stage(build_gpt("tiny", n_layers=5), 2, 0)
    assert list(first.layers.keys()) == ["0", "1", "2"] and first.output is None and first.norm is None


def test_clean_name():
    assert clean_name("module.layers.0._checkpoint_wrapped_module.attention.wq.weight", ddp=True) == \
        "layers.0.attention.wq.weight"
    assert clean_name("layers.1._orig_mod.ffn_norm.weight") == "layers.1.ffn_norm.weight"
    assert clean_name("module.x", ddp=False) == "module.x"


def test_single_process_mesh_is_none():
    from crosstrain import registry

    collective = registry.get_backend("cpu").collective()
    dims = ParallelDims(world_size=1)
    assert build_mesh(collective, dims) is None and dims.dp_shard == 1
    assert dp_rank_and_size(None, dims) == (0, 1)


def test_parallelize_rejects_bad_options():
    dims = ParallelDims(world_size=1).resolve()
    raises_one_line(lambda: parallelize(build_gpt("tiny"), dims, None, torch.device("cpu"), precision="fp8"),
                    "precision.dtype='fp8'")
    raises_one_line(lambda: parallelize(build_gpt("tiny"), dims, None, torch.device("cpu"), pp_schedule="zb"),
                    "parallel.pp_schedule='zb'")
    raises_one_line(lambda: parallelize(build_gpt("tiny"), dims, None, torch.device("cpu"),
                                        activation_checkpoint="every:0"), "every:N")
    raises_one_line(lambda: parallelize(build_gpt("tiny"), ParallelDims(tp=2, world_size=2).resolve(), None,
                                        torch.device("cpu"), compile=True), "parallel.compile", "parallel.tp")
    raises_one_line(lambda: parallelize(torch.nn.Linear(4, 4), dims, None, torch.device("cpu"),
                                        activation_checkpoint="full"), "model class Linear", "ac_units()")


def _plain_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    ref = build_gpt("tiny")
    logits = ref(x)
    loss = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    (loss * 0.5).backward()
    return ref, loss


@pytest.mark.parametrize("options", [
    {},
    {"activation_checkpoint": "full"},
])
def test_single_process_matches_plain_model(options):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    ref, ref_loss = _plain_step(x, y)
    torch.manual_seed(0)
    pm = parallelize(build_gpt("tiny"), ParallelDims(world_size=1).resolve(), None, torch.device("cpu"), **options)
    loss, timings = pm.forward_backward(x, y, scale=2.0, divisor=4)  # gradients of loss * 0.5
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert timings["forward_s"] >= 0 and timings["backward_s"] >= 0
    grads = dict(pm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6)
    state = pm.full_state_dict()
    assert list(state) == sorted(ref.state_dict())
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    assert pm.eval_loss(x, y).item() == pytest.approx(ref_loss.item(), rel=1e-6)
    norm = pm.clip_grad_norm_(1e-3)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    assert norm.item() == pytest.approx(want.item(), rel=1e-5)
    clipped = dict(pm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(clipped[name].grad, p.grad, rtol=1e-5, atol=1e-8)


def test_compile_with_checkpointing_traces_blocks_without_graph_breaks():
    """``compile`` names a dynamo backend here (aot_eager: tracing without inductor's C++ build time)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randint(0, 256, (2, 16))
    ref, ref_loss = _plain_step(x, x)
    torch.manual_seed(0)
    pm = parallelize(build_gpt("tiny"), ParallelDims(world_size=1).resolve(), None, torch.device("cpu"),
                     compile="aot_eager", activation_checkpoint="every:2")
    loss, _ = pm.forward_backward(x, x, divisor=2)
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    grads = dict(pm.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_single_process():
    torch.manual_seed(0)
    pm = parallelize(build_gpt("tiny"), ParallelDims(world_size=1).resolve(), None, torch.device("cpu"),
                     precision="bf16")
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        want = kernels.cross_entropy(build_gpt("tiny")(x).reshape(-1, 256), x.reshape(-1))
    loss, _ = pm.forward_backward(x, x)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in pm.parameters())
