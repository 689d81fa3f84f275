"""Mixtral and Qwen3-MoE as native MoE models: routers against transformers'
own router modules, logits and greedy tokens against transformers, HF -> crosstrain -> HF bit-exact, 1 vs 2 ranks
(dp_shard=2, ep=2, tp=2), training from ``model.init_from`` with the balance loss on, and the one-line refusals.

Every model is built here from transformers' config classes with random weights (norms moved off 1, routers with a
large std so tokens really pick different experts), saved sharded. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch

transformers = pytest.importorskip("transformers")

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.config import load_config  # noqa: E402
from crosstrain.errors import ConfigError  # noqa: E402
from crosstrain.kernels import registry  # noqa: E402
from crosstrain.plugins.moe import router  # noqa: E402
from crosstrain.recipes.lm import build_model  # noqa: E402

SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
#: family -> (config class, model class, its MoE keys)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    # Qwen3's q/k norm and an explicit head_dim; block 0 dense (mlp_only_layers), raw top-k weights
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=80, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=24,
        num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=False, router_aux_loss_coef=0.02)),
}


WINDOW = 8
WINDOWED = ("mixtral_window", "qwen3_moe_window")


def save_hf(family: str, folder: Path, **extra: Any) -> torch.nn.Module:
    """A random tiny HF model of ``family`` saved sharded to ``folder`` (norms off 1, routers that route)."""
    cfg_name, model_name, moe = FAMILIES[family]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    torch.manual_seed(11)
    model = model_cls(cfg_cls(**{**SHAPE, **moe, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, max_shard_size="100KB")
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_hf")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        save_hf(family, dirs[family])
    dirs["mixtral_top1"] = root / "mixtral_top1"  # Mixtral renormalises even one weight (to 1)
    save_hf("mixtral", dirs["mixtral_top1"], num_experts_per_tok=1)
    # windows of 8 tokens on every layer (transformers' Qwen3-MoE ignores max_window_layers)
    dirs["mixtral_window"] = root / "mixtral_window"
    save_hf("mixtral", dirs["mixtral_window"], sliding_window=WINDOW)
    dirs["qwen3_moe_window"] = root / "qwen3_moe_window"
    save_hf("qwen3_moe", dirs["qwen3_moe_window"], use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    return dirs


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), registry.use_reference():
        out = model(ids)
    return getattr(out, "logits", out)


def test_routers_match_transformers_and_closed_forms() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 16, generator=g), torch.randn(6, 16, generator=g)
    logits = x @ w.t()
    scores = router.router_scores(logits, "softmax")
    # top-k then softmax (Mixtral's paper) == softmax, top-k, renormalise (transformers)
    ids, weights = router.top_k(scores, 2, renormalize="always")
    ids2, weights2 = router.top_k_softmax(logits, 2)
    assert torch.equal(ids, ids2) and torch.allclose(weights, weights2, atol=1e-6)
    # closed forms: never = the raw probabilities, always = divided by their sum, auto = always for k > 1
    _, raw = router.top_k(scores, 2, renormalize="never")
    assert torch.allclose(raw, scores.gather(-1, ids)) and raw.sum(-1).max() < 1
    assert torch.allclose(weights, raw / raw.sum(-1, keepdim=True))
    assert torch.equal(router.top_k(scores, 2)[1], weights)
    assert torch.equal(router.top_k(scores, 1, renormalize="always")[1], torch.ones(9, 1))
    assert torch.equal(router.top_k(scores, 1)[1], scores.max(-1, keepdim=True).values)  # Switch's top-1
    for k in (1, 2, 3):
        mix = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=k))
        mix.weight.data.copy_(w)
        _, their_w, their_ids = mix(x)
        ours = router.top_k(scores, k, renormalize="always")
        assert torch.equal(ours[0], their_ids) and torch.allclose(ours[1], their_w, atol=1e-6)
        for norm in (False, True):
            qcfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=k,
                                               norm_topk_prob=norm)
            qwen = Qwen3MoeTopKRouter(qcfg)
            qwen.weight.data.copy_(w)
            _, their_w, their_ids = qwen(x)
            ours = router.top_k(scores, k, renormalize="always" if norm else "never")
            assert torch.equal(ours[0], their_ids) and torch.allclose(ours[1], their_w, atol=1e-6)


def test_logits_and_greedy_tokens_match_transformers(
    hf_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str],
) -> None:
    from crosstrain.models.family import param_count
    from crosstrain.plugins.moe.transform import moe_layers

    prompt = torch.randint(0, SHAPE["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(0))
    for family in [*FAMILIES, "mixtral_top1", *WINDOWED]:
        folder = hf_dirs[family]
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        config = load_config(None, [f"model.init_from={folder}"])
        model = build_model(config).eval()
        layers = moe_layers(model)
        # the layout estimate counts the experts without building the model
        assert param_count(config) == sum(p.numel() for p in model.parameters()), family
        assert layers and all(layer.cfg.capacity_factor == 0 for layer in layers)
        seen: list[torch.Tensor] = []
        hook = layers[0].register_forward_pre_hook(lambda _m, args, seen=seen: seen.append(args[0].reshape(-1, 64)))
        assert torch.allclose(_logits(model, ids), _logits(ref, ids), atol=1e-5, rtol=0), family
        hook.remove()
        picked = torch.topk(seen[0] @ layers[0].router.weight.t(), layers[0].cfg.top_k).indices
        assert len({tuple(sorted(row)) for row in picked.tolist()}) >= 3, family  # tokens pick different experts
        capsys.readouterr()
        text = ",".join(str(i) for i in prompt[0].tolist())
        assert main(["generate", str(folder), "--prompt-ids", text, "--max-new-tokens", "32", "--json"]) == 0
        new_ids = json.loads(capsys.readouterr().out)["new_ids"]
        with torch.no_grad():
            greedy = ref.generate(prompt, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt))
        assert greedy[0, prompt.shape[1]:].tolist() == new_ids and len(new_ids) == 32, family


def test_round_trip_hf_crosstrain_hf_is_bit_exact(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    from crosstrain.models.hf import iter_tensors, load_pretrained

    for family in [*FAMILIES, *WINDOWED]:
        out = tmp_path / family
        assert main(["export", str(hf_dirs[family]), "--format", "hf", "--out", str(out),
                     "--max-shard-size", "100KB"]) == 0
        before, after = dict(iter_tensors(hf_dirs[family])), dict(iter_tensors(out))
        assert sorted(before) == sorted(after), family
        for name, tensor in before.items():
            assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
        assert (out / "model.safetensors.index.json").is_file()
        theirs = json.loads((hf_dirs[family] / "config.json").read_text())
        ours = json.loads((out / "config.json").read_text())
        for key in ("model_type", "num_experts_per_tok", "router_aux_loss_coef", "num_local_experts", "num_experts",
                    "moe_intermediate_size", "intermediate_size", "norm_topk_prob", "mlp_only_layers",
                    "decoder_sparse_step", "head_dim", "architectures", "sliding_window", "use_sliding_window"):
            if theirs.get(key) is not None:  # Mixtral's head_dim null: ours names hidden / heads
                assert ours.get(key) == theirs[key], (family, key)
        ids = torch.arange(12).view(1, 12)
        ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).eval()
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(_logits(back, ids), _logits(ref, ids)), family
        # transformers 5's in-memory names (fused experts.gate_up_proj / down_proj) are read as well
        fused = tmp_path / f"{family}_fused"
        fused.mkdir()
        state = {k: v.contiguous() for k, v in ref.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(hf_dirs[family] / "config.json", fused / "config.json")
        assert torch.equal(_logits(load_pretrained(fused), ids), _logits(load_pretrained(hf_dirs[family]), ids))


def test_training_from_init_from_lowers_the_loss_and_exports(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """12 steps from the Mixtral folder: the balance loss on with router_aux_loss_coef, no z-loss (the checkpoint
    has none), the loss falls, and the trained run exports to a folder transformers loads with the same logits."""
    from crosstrain.engine import Trainer
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.moe.transform import moe_layers

    run = tmp_path / "run"
    cfg = load_config(None, [f"model.init_from={hf_dirs['mixtral']}", "train.steps=12", "train.batch_size=4",
                             "train.seq_len=32", "logging.progress=none", "schedule.warmup_steps=0", "eval.every=0",
                             "model.max_seq_len=64"])
    trainer = Trainer(cfg, run_dir=run)
    trainer.fit()
    layers = moe_layers(trainer.context.models["model"])
    assert len(layers) == 2 and {(x.cfg.aux_loss_coeff, x.cfg.z_loss_coeff, x.cfg.top_k) for x in layers} == {
        (0.02, 0.0, 2)}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses
    assert all(r["aux/moe_load_balance"] > 0 and "aux/moe_z_loss" not in r for r in rows)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.allclose(_logits(hf, ids), _logits(load_model(run).model, ids), atol=1e-5, rtol=0)


def test_refusals_are_one_line(hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What would change the imported model's function is refused before any worker starts, in one line."""
    import shutil

    from crosstrain.config.loader import check_world

    init = f"model.init_from={hf_dirs['mixtral']}"
    for extra, words in ((["moe.capacity_factor=1.25"], "moe.capacity_factor=1.25 would drop tokens"),
                         (["moe.experts=8"], "moe.experts=8 contradicts"),
                         (["moe.renormalize=never"], "moe.renormalize='never' contradicts")):
        with pytest.raises(ConfigError, match=words):
            check_world(load_config(None, [init, *extra]), 1)
    assert main(["train", "--set", init, "--set", "moe.capacity_factor=1.25"]) == 2
    err = capsys.readouterr().err.strip()
    assert "moe.capacity_factor=1.25" in err and len(err.splitlines()) == 1
    from crosstrain.engine import Trainer  # experts trained from scratch have no HF format to keep

    Trainer(load_config(None, ["moe.experts=4", "train.steps=1", "train.batch_size=2", "train.seq_len=16",
                               "logging.progress=none", "eval.every=0"]), run_dir=tmp_path / "scratch").fit()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "scratch"), "--format", "hf", "--out", str(tmp_path / "out")]) == 6
    err = capsys.readouterr().err.strip()
    assert "expert_bias' has no llama equivalent" in err and len(err.splitlines()) == 1
    from crosstrain.plugins.moe.hf_adapter import ADAPTERS  # a moved expert bias has no HF counterpart

    with pytest.raises(ConfigError, match="expert_bias is not zero"):
        ADAPTERS["mixtral"].to_hf_tensors({"layers.0.feed_forward.expert_bias": torch.tensor([0.0, 0.1])})
    for changes, words in (({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
                           ({"hidden_act": "gelu"}, "hidden_act='gelu'")):
        folder = tmp_path / "m"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(hf_dirs["mixtral"], folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
        with pytest.raises(ConfigError, match=words):
            load_config(None, [f"model.init_from={folder}"])


LAYOUTS = {"dp_shard=2": {"dp_shard": 2}, "dp_shard=2,ep=2": {"dp_shard": 2, "ep": 2}, "tp=2": {"dp_shard": 1, "tp": 2}}


def _batch() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(5))


def _step(module: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the training loss: cross-entropy + the balance loss (pooled scope, router_aux_loss_coef)."""
    from crosstrain.engine.aux_loss import collect_aux_losses
    from crosstrain.parallel import next_token_loss

    with collect_aux_losses() as aux:
        logits = module(tokens[:, :-1])
    assert set(aux) == {"moe_load_balance"}
    return logits, next_token_loss(logits, tokens[:, 1:]) + sum(aux.values())


def _ranks(collective: Any, folders: dict[str, str]) -> dict[str, Any]:
    """Each family under each layout on this rank's half of the batch: logits, loss, full gradients, grad norm."""
    from torch.distributed.tensor import DTensor

    from crosstrain.models.hf import load_pretrained
    from crosstrain.parallel import ParallelDims, build_mesh, parallelize
    from crosstrain.parallel.state import clean_name
    from crosstrain.plugins.moe.transform import moe_layers

    got: dict[str, Any] = {}
    half = _batch()[2 * collective.rank: 2 * collective.rank + 2]
    for family, folder in folders.items():
        for layout, dims_kw in LAYOUTS.items():
            dims = ParallelDims(**dims_kw, world_size=2).resolve()
            pm = parallelize(load_pretrained(folder), dims, build_mesh(collective, dims), torch.device("cpu"))
            pm.module.train()
            with pm.micro_batch(), registry.use_reference():  # tp: both ranks compute the whole batch
                logits, loss = _step(pm.module, _batch() if dims.tp > 1 else half)
                loss.backward()
            grads = {clean_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy()
                     for n, p in pm.module.named_parameters()}
            experts = moe_layers(pm.module)[0].experts
            got[f"{family}/{layout}"] = {"logits": logits.detach().numpy(), "loss": float(loss.detach()),
                                         "grads": grads, "norm": float(pm.grad_norm()), "ep_size": experts.ep_size}
    return got


def test_two_ranks_match_one_process(hf_dirs: dict[str, Path]) -> None:
    """dp_shard=2, dp_shard=2 x ep=2 (experts split over the ranks) and tp=2 against one process on the whole batch:
    logits, the loss (cross-entropy + pooled balance loss; the ranks' mean under dp), every gradient and the
    gradient norm within 1e-5."""
    from crosstrain.models.hf import load_pretrained

    per_rank = shared_ranks.run(_ranks, {f: str(hf_dirs[f]) for f in FAMILIES}, timeout=300)
    tokens = _batch()
    for family in FAMILIES:
        model = load_pretrained(hf_dirs[family]).train()
        with registry.use_reference():
            logits, loss = _step(model, tokens)
            loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        for layout in LAYOUTS:
            got = [r[f"{family}/{layout}"] for r in per_rank]
            assert [g["ep_size"] for g in got] == [LAYOUTS[layout].get("ep", 1)] * 2  # experts really split
            whole = "tp" in layout  # tp: each rank's logits and loss are the whole batch's
            for rank in range(2):
                want = logits.detach() if whole else logits.detach()[2 * rank: 2 * rank + 2]
                torch.testing.assert_close(torch.from_numpy(got[rank]["logits"]), want, rtol=1e-5, atol=1e-5)
                for name, p in model.named_parameters():
                    torch.testing.assert_close(torch.from_numpy(got[rank]["grads"][name]), p.grad, rtol=1e-5,
                                               atol=1e-5, msg=f"{family} {layout} {name}")
            mean = got[0]["loss"] if whole else (got[0]["loss"] + got[1]["loss"]) / 2
            assert abs(mean - float(loss.detach())) < 1e-5, (family, layout)
            assert abs(got[0]["norm"] - float(norm)) < 1e-5 * float(norm), (family, layout)


def test_balance_loss_is_transformers_load_balancing_loss(hf_dirs: dict[str, Path]) -> None:
    """The imported families train with transformers' balance loss (``output_router_logits=True``): the Switch
    factors pooled over every MoE layer, counts of all k choices. The closed form on uniform routing, the pure
    function against ``load_balancing_loss_func`` on random router logits, then whole models: cross-entropy +
    ``router_aux_loss_coef`` x aux and the router gradients equal transformers' within 1e-5."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from crosstrain.models.hf import load_pretrained
    from crosstrain.plugins.moe import balance

    uniform = torch.full((6, 4), 0.25)
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 2], [1, 3]])
    assert abs(float(balance.pooled_aux_loss(balance.pooled_stats(uniform, ids), coeff=0.1)) - 0.1 * 2) < 1e-7
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(10, 6, generator=g) for _ in range(3)]
    stats = sum(balance.pooled_stats(lg.softmax(-1), lg.softmax(-1).topk(2).indices) for lg in layers)
    assert isinstance(stats, torch.Tensor)
    theirs = load_balancing_loss_func(tuple(layers), num_experts=6, top_k=2)
    torch.testing.assert_close(balance.pooled_aux_loss(stats, coeff=1.0), theirs, rtol=1e-6, atol=1e-7)
    # not the per-layer Switch loss summed over layers, which the scopes other than "pooled" compute
    per_layer = sum(balance.switch_aux_loss(lg.softmax(-1), lg.softmax(-1).topk(2).indices, 1.0) for lg in layers)
    assert abs(float(per_layer) - float(theirs)) > 0.1

    tokens = _batch()
    for family, (_, _, moe) in FAMILIES.items():
        ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).train()
        out = ref(tokens[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
        (ce + moe["router_aux_loss_coef"] * out.aux_loss).backward()
        ours = load_pretrained(hf_dirs[family]).train()
        with registry.use_reference():
            _, loss = _step(ours, tokens)
        loss.backward()
        want = ce.detach() + moe["router_aux_loss_coef"] * out.aux_loss.detach()
        assert abs(float(loss.detach()) - float(want)) < 1e-5, family
        sparse = [i for i in range(ref.config.num_hidden_layers) if i not in moe.get("mlp_only_layers", [])]
        for i in sparse:
            their_grad = ref.model.layers[i].mlp.gate.weight.grad
            our_grad = ours.get_submodule(f"layers.{i}.feed_forward.router").weight.grad
            torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-6, msg=f"{family} layer {i}")
