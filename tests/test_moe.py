"""The MoE plugin in one process: each formula against its closed form, the layer against a per-expert loop,
capacity dropping, the balancing terms and metrics through the loop's collectors, the config section, and a
short training run (aux losses and metrics reported, the aux-loss-free bias moving)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from crosstrain.config import load_config
from crosstrain.engine.aux_loss import add_metric, collect_aux_losses, collect_metrics
from crosstrain.errors import ConfigError
from crosstrain.plugins.moe import balance, capacity, router
from crosstrain.plugins.moe.config import MoESection
from crosstrain.plugins.moe.layer import MoELayer
from crosstrain.plugins.moe.transform import is_moe_block, moe_layers, to_moe

E, COEFF = 4, 0.1


# -- formulas -----------------------------------------------------------------------------------------------------
def test_capacity_is_the_gshard_formula():
    assert capacity.expert_capacity(64, 2, 8, 1.25) == math.ceil(64 * 2 / 8 * 1.25) == 20
    assert capacity.expert_capacity(10, 1, 4, 1.0) == 3


def test_capacity_keep_by_position_and_by_probability():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.5, 0.5]])
    # position: first choices in token order, then second choices; expert 0 keeps 2 of its 4 copies
    by_position = capacity.capacity_keep(ids, weights, E, 2, "position")
    assert by_position.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    # probs: expert 0 keeps its two largest weights (0.9 and 0.7)
    by_probs = capacity.capacity_keep(ids, weights, E, 2, "probs")
    assert by_probs.tolist() == [[False, True], [True, True], [True, True], [True, False]]
    assert capacity.capacity_keep(ids, weights, E, 8, "probs").all()


def test_switch_aux_loss_closed_forms():
    n = 8
    uniform = torch.full((n, E), 1 / E)
    balanced = torch.arange(n).remainder(E)[:, None]
    assert balance.switch_aux_loss(uniform, balanced, COEFF).item() == pytest.approx(COEFF)
    collapsed = torch.zeros(n, E)
    collapsed[:, 0] = 1
    assert balance.switch_aux_loss(collapsed, torch.zeros(n, 1, dtype=torch.long), COEFF).item() == pytest.approx(
        COEFF * E)
    # f from given counts (the global-batch variant): f = (1, 0, 0, 0), P_0 = 1/E -> coeff
    counts = torch.tensor([5.0, 0, 0, 0])
    assert balance.switch_aux_loss(uniform, balanced, COEFF, counts=counts).item() == pytest.approx(COEFF)
    # only P carries the gradient: d/dP_i = coeff * E * f_i / N per token
    probs = uniform.clone().requires_grad_()
    balance.switch_aux_loss(probs, torch.zeros(n, 1, dtype=torch.long), COEFF).backward()
    assert probs.grad[:, 0].tolist() == pytest.approx([COEFF * E / n] * n) and probs.grad[:, 1:].abs().sum() == 0


def test_sequence_aux_loss_is_the_mean_over_sequences():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 5, E, generator=g), -1)
    ids = torch.randint(0, E, (3, 5, 2), generator=g)
    per_seq = [balance.switch_aux_loss(probs[b], ids[b], COEFF) for b in range(3)]
    assert balance.sequence_aux_loss(probs, ids, COEFF).item() == pytest.approx(float(sum(per_seq) / 3))


def test_z_loss_entropy_and_bias_update_closed_forms():
    assert balance.z_loss(torch.zeros(6, E), COEFF).item() == pytest.approx(COEFF * math.log(E) ** 2)
    assert balance.z_loss(torch.zeros(2, E, dtype=torch.bfloat16), 1.0).dtype == torch.float32
    assert balance.router_entropy(torch.full((3, E), 1 / E)).item() == pytest.approx(math.log(E))
    bias = balance.bias_update(torch.zeros(E), torch.tensor([10.0, 2, 4, 4]), 0.01)  # mean load 5
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_router_scores_top_k_and_jitter():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.bfloat16)
    soft = router.router_scores(logits, "softmax")
    assert soft.dtype == torch.float32 and soft.sum().item() == pytest.approx(1.0)
    sig = router.router_scores(logits, "sigmoid")
    assert sig.tolist()[0] == pytest.approx(torch.sigmoid(logits.float()).tolist()[0])
    assert router.routing_distribution(sig, "sigmoid").sum().item() == pytest.approx(1.0)
    ids, weights = router.top_k(soft, 2)
    assert ids.tolist() == [[0, 1]] and weights.sum().item() == pytest.approx(1.0)
    # the bias moves the choice, never the weights: the chosen experts' own scores, renormalised
    ids, weights = router.top_k(soft, 2, bias=torch.tensor([0.0, 0, 0, 1]))
    s = soft[0]
    assert ids.tolist() == [[3, 0]] and weights[0].tolist() == pytest.approx((s[[3, 0]] / s[[3, 0]].sum()).tolist())
    _, single = router.top_k(soft, 1)
    assert single.item() == pytest.approx(s[0].item())  # top-1 keeps the raw probability (Switch)
    x = torch.ones(1000)
    noisy = router.jitter(x, 0.1)
    assert 0.9 <= noisy.min() and noisy.max() <= 1.1 and noisy.std() > 0 and router.jitter(x, 0.0) is x


def test_every_picks_the_blocks():
    assert [i for i in range(4) if is_moe_block(i, 1)] == [0, 1, 2, 3]
    assert [i for i in range(4) if is_moe_block(i, 2)] == [1, 3]


# -- the layer ----------------------------------------------------------------------------------------------------
def _layer(**overrides) -> MoELayer:
    layer = MoELayer(16, 24, MoESection(experts=E, **overrides))
    layer.init_weights(0.2, 0.2, torch.Generator().manual_seed(1))
    return layer


def _loop_reference(layer: MoELayer, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """A per-expert Python loop over the same weights (DeepSpeed-MoE's ``experts.py`` shape)."""
    flat = x.reshape(-1, x.shape[-1])
    scores = router.router_scores(flat.float() @ layer.router.weight.float().t(), layer.cfg.router)
    ids, weights = router.top_k(scores, layer.cfg.top_k)
    if keep is not None:
        weights = weights * keep
    out = torch.zeros_like(flat)
    ex = layer.experts
    for e in range(E):
        for slot in range(ids.shape[1]):
            rows = ids[:, slot] == e
            h = torch.nn.functional.silu(flat[rows] @ ex.w1[e]) * (flat[rows] @ ex.w3[e])
            out[rows] += weights[rows, slot, None] * (h @ ex.w2[e])
    if layer.shared is not None:
        out = out + layer.shared(flat)
    return out.view_as(x)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_dropless_layer_matches_a_per_expert_loop(kind):
    layer = _layer(router=kind, shared_experts=1)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = layer(x)
    ref = _loop_reference(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), [x, layer.experts.w1, layer.router.weight])
    want = torch.autograd.grad(ref.square().sum(), [x, layer.experts.w1, layer.router.weight])
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_capacity_layer_drops_copies_and_reports_it():
    layer = _layer(capacity_factor=0.5, drop_policy="position")
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, 16)
    ids, weights = router.top_k(router.router_scores(flat @ layer.router.weight.t(), "softmax"), 2)
    cap = capacity.expert_capacity(12, 2, E, 0.5)
    keep = capacity.capacity_keep(ids, weights, E, cap, "position")
    assert not keep.all()
    with collect_aux_losses(), collect_metrics() as metrics, torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, _loop_reference(layer, x, keep), rtol=1e-5, atol=1e-6)
    assert float(metrics["moe/0/drop_rate"]) == pytest.approx(1 - float(keep.sum()) / 24)
    torch.testing.assert_close(_layer(capacity_factor=8.0)(x), _layer()(x))  # never reached: dropless


def test_training_forward_adds_aux_losses_and_metrics_and_eval_adds_nothing():
    layer = _layer(aux_loss_coeff=COEFF, z_loss_coeff=0.01, bias_update_rate=0.1)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    with collect_aux_losses() as aux, collect_metrics() as metrics:
        layer(x)
    assert set(aux) == {"moe_load_balance", "moe_z_loss"}
    assert set(metrics) == {f"moe/0/{k}" for k in ("max_load", "mean_load", "drop_rate", "router_entropy")}
    assert float(metrics["moe/0/mean_load"]) == 2 * 12 / E and float(layer.load_sum.sum()) == 24
    for variant in ("sequence", "global"):
        with collect_aux_losses() as other:
            _layer(aux_loss=variant, aux_loss_coeff=COEFF)(x)
        assert other["moe_load_balance"].item() > 0
    layer.update_bias()
    assert layer.expert_bias.abs().sum() > 0 and layer.load_sum.sum() == 0
    with collect_aux_losses() as aux:
        layer.eval()(x)
    assert not aux  # eval forward: nothing is added, no loads counted
    assert layer.load_sum.sum() == 0


def test_add_metric_averages_and_is_a_no_op_outside_training():
    add_metric("ignored", 1.0)
    with collect_metrics() as metrics:
        add_metric("m", torch.tensor(1.0))
        add_metric("m", 3.0)
    assert metrics == {"m": torch.tensor(2.0)}


def test_transform_keeps_rng_and_builds_identical_copies():
    from crosstrain.models.gpt import build_gpt

    torch.manual_seed(0)
    a = to_moe(build_gpt("tiny"), MoESection(experts=E, every=2), seed=5)
    after = torch.rand(1)
    torch.manual_seed(0)
    b = to_moe(build_gpt("tiny"), MoESection(experts=E, every=2), seed=5)
    assert torch.rand(1) == after  # the global stream is untouched
    assert [m.layer for m in moe_layers(a)] == ["layers.1.feed_forward"]
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["moe.experts=2", "moe.top_k=3"])
    assert "moe.top_k=3 exceeds moe.experts=2" in str(info.value) and "\n" not in str(info.value)
    from crosstrain.config import check_world
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.moe.setup import transform

    for overrides, words in ((["moe.experts=3", "parallel.ep=2"], "parallel.ep=2 must divide moe.experts=3"),
                             (["moe.experts=4", "parallel.pp=2"], "parallel.pp=2"),):
        with pytest.raises(ConfigError, match=words):  # before any worker starts (plugins/moe/rules.py)
            check_world(load_config(None, overrides), 2)
    with pytest.raises(ConfigError, match="needs the built-in GPT"):
        to_moe(torch.nn.Linear(2, 2), MoESection(experts=2))
    assert transform(build_gpt("tiny"), load_config(None, [])) is None  # experts = 0: dense, untouched


def test_training_run_reports_moe_terms_and_moves_the_bias(tmp_path):
    from crosstrain.engine import Trainer

    cfg = load_config(None, ["train.steps=3", "train.batch_size=4", "train.seq_len=32", "logging.progress=none",
                             "backend=cpu", "schedule.warmup_steps=0", f"train.output_dir={tmp_path}",
                             "moe.experts=4", "moe.bias_update_rate=0.01", "moe.capacity_factor=1.0"])
    trainer = Trainer(cfg, run_dir=tmp_path / "r")
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for key in ("aux/moe_load_balance", "aux/moe_z_loss", "moe/0/max_load", "moe/1/drop_rate",
                "moe/1/router_entropy"):
        assert key in last and math.isfinite(last[key]), key
    layers = moe_layers(trainer.context.models["model"])
    assert len(layers) == 2 and all(layer.expert_bias.abs().sum() > 0 for layer in layers)


def test_upcycled_model_computes_the_dense_model(tmp_path):
    from crosstrain.engine import Trainer
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.moe.setup import transform

    small = ["train.steps=2", "train.batch_size=2", "train.seq_len=16", "logging.progress=none", "backend=cpu",
             "model.n_layers=2", "model.dim=32", "model.n_heads=2", f"train.output_dir={tmp_path}"]
    Trainer(load_config(None, small), run_dir=tmp_path / "dense").fit()
    dense = load_model(tmp_path / "dense").model
    cfg = load_config(None, [*small, "moe.experts=8", "moe.top_k=2", f"moe.upcycle_from={tmp_path / 'dense'}"])
    moe = transform(build_gpt("tiny", n_layers=2, dim=32, n_heads=2), cfg)
    assert moe is not None and len(moe_layers(moe)) == 2
    assert moe_layers(moe)[0].experts.w1.shape == (8, 32, dense.config.hidden_dim)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(tokens), dense(tokens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="set moe.shared_experts=0"):
        transform(build_gpt("tiny", n_layers=2, dim=32, n_heads=2),
                  load_config(None, [*small, "moe.experts=4", "moe.shared_experts=1",
                                     f"moe.upcycle_from={tmp_path / 'dense'}"]))


def test_activation_checkpointing_recomputes_the_same_layer():
    """Full AC recomputes each block in the backward: same loss terms and gradients as without it (1e-6)."""
    from crosstrain.models.gpt import build_gpt
    from crosstrain.parallel import ParallelDims, next_token_loss, parallelize

    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(6))
    grads = []
    for ac in ("none", "full"):
        torch.manual_seed(0)
        model = to_moe(build_gpt("tiny"), MoESection(experts=E, aux_loss="sequence", bias_update_rate=0.1), seed=2)
        pm = parallelize(model, ParallelDims(world_size=1).resolve(), None, torch.device("cpu"),
                         activation_checkpoint=ac)
        with pm.micro_batch(), collect_aux_losses() as aux:
            loss = next_token_loss(pm.module(tokens[:, :-1]), tokens[:, 1:]) + sum(aux.values())
        loss.backward()
        assert float(moe_layers(model)[0].load_sum.sum()) == 2 * 16 * 2  # counted once, not again in the recompute
        grads.append({n: p.grad for n, p in pm.named_parameters()})
    assert set(grads[0]) == set(grads[1])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-6, msg=name)
