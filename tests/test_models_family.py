"""Model families (crosstrain.models.family): the gpt bundle's presets, checks and estimates against built models,
the MoE plugin's contribution to them, a plugin family registered through the hook, and the scalar-head swap."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from one_line import raises_one_line
from torch import nn

from crosstrain import hookimpl, pluginmanager
from crosstrain.config import check_world, gpt_config, load_config
from crosstrain.engine.flops import count_flops, training_flops_per_token
from crosstrain.errors import ConfigError
from crosstrain.models.family import (
    FamilyExtension,
    ModelFamily,
    families,
    family_for_preset,
    family_of,
    param_count,
    swap_scalar_head,
)
from crosstrain.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from crosstrain.models.hf import ADAPTERS, adapter_for
from crosstrain.parallel import ParallelDims
from crosstrain.parallel.layout import estimate_train_bytes


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_gpt_family_owns_the_presets_and_reads_the_run_config():
    gpt = families()["gpt"]
    assert family_for_preset("small") is gpt and gpt.presets is PRESETS
    raises_one_line(lambda: load_config(None, ["model.preset=huge"]), "unknown model.preset 'huge'", "tiny, small")
    cfg = gpt_config(load_config(None, ["model.preset=small", "model.n_layers=3"]))
    assert cfg == GPTConfig(**{**PRESETS["small"].to_dict(), "n_layers": 3})
    assert isinstance(gpt.build(cfg), GPT) and family_of(gpt.build(cfg)) is gpt
    assert family_of(nn.Linear(2, 2)) is None
    raises_one_line(lambda: load_config(None, ["model.dim=60", "model.n_heads=8"]), "model.dim=60", "model.n_heads=8")
    raises_one_line(lambda: load_config(None, ["train.seq_len=512"]), "train.seq_len=512", "max_seq_len=256")


def test_validate_parallel():
    check = families()["gpt"].validate_parallel
    tiny = GPTConfig(dim=64, n_layers=2, n_heads=4)
    check(tiny, ParallelDims(tp=2, world_size=2).resolve())
    raises_one_line(lambda: check(tiny, ParallelDims(tp=3, world_size=3).resolve()), "parallel.tp=3", "model.n_heads=4")
    gqa = GPTConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2)
    raises_one_line(lambda: check(gqa, ParallelDims(tp=4, world_size=4).resolve()), "parallel.tp=4", "kv heads")
    raises_one_line(
        lambda: check(tiny, ParallelDims(pp=3, world_size=3).resolve()), "parallel.pp=3", "model.n_layers=2"
    )
    tied = GPTConfig(dim=64, n_layers=2, n_heads=4, tie_embeddings=True)
    raises_one_line(lambda: check(tied, ParallelDims(pp=2, world_size=2).resolve()), "tie_embeddings")
    raises_one_line(
        lambda: check(GPTConfig(vocab_size=255), ParallelDims(tp=2, world_size=2).resolve()), "model.vocab_size=255"
    )
    raises_one_line(
        lambda: check_world(load_config(None, ["parallel.tp=4", "model.n_heads=2"]), 4),  # the launcher's
        "parallel.tp=4",
        "model.n_heads=2",
    )


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.preset=small", "model.n_kv_heads=2", "model.tie_embeddings=true"],
        ["moe.experts=4"],
        ["moe.experts=4", "moe.every=2", "moe.shared_experts=1", "moe.top_k=1"],
        ["moe.experts=2", "moe.expert_dim=40"],
    ],
)
def test_param_count_is_the_built_and_transformed_model(overrides):
    """The estimate behind parallel.layout=auto counts what the run trains: the GPT and the MoE plugin's experts."""
    from crosstrain.plugins.moe.setup import transform
    from crosstrain.recipes.lm import build_model

    config = load_config(None, overrides)
    model = build_model(config)
    model = transform(model, config) or model
    assert param_count(config) == _count(model)


def test_layout_estimate_counts_the_experts():
    dense, moe = load_config(None, []), load_config(None, ["moe.experts=8"])
    extra = param_count(moe) - param_count(dense)
    assert extra > 0
    assert estimate_train_bytes(moe, 4) - estimate_train_bytes(dense, 4) == extra * (4 + 4 + 4 + 8)  # adamw state


def test_flops_count_the_experts_a_token_uses():
    """6 x (non-embedding parameters a token uses: top_k of E routed experts) + 12 L D T (PaLM's estimate)."""
    from crosstrain.plugins.moe.setup import transform
    from crosstrain.recipes.lm import build_model

    seq = 64
    dense = build_model(load_config(None, []))
    assert training_flops_per_token(dense, seq) == dense.flops_per_token(seq)
    config = load_config(None, ["moe.experts=4", "moe.top_k=1", "moe.every=2"])
    moe = transform(build_model(config), config)
    used = 0.0
    for name, p in moe.named_parameters():
        if name == "tok_embeddings.weight":
            continue
        used += p.numel() * (1 / 4 if ".experts." in name else 1)
    cfg = moe.config
    expected = 6 * used + 12 * cfg.n_layers * cfg.dim * seq
    assert training_flops_per_token(moe, seq) == pytest.approx(expected, rel=1e-12)
    total, record = count_flops([("model", moe, True), ("reference", moe, False)], seq)
    assert total == pytest.approx(expected * 4 / 3, rel=1e-12)
    assert record["model"]["counted"] == "forward + backward: the model's flops_per_token"


def test_hf_adapters_come_from_the_family():
    assert adapter_for("qwen2") is ADAPTERS["qwen2"] and families()["gpt"].hf_adapters is ADAPTERS
    raises_one_line(lambda: adapter_for("gemma"), "model_type 'gemma'", "llama, mistral, qwen2")


# -- a plugin's own family, through the crosstrain_model_families hook ---------------------------------------------
@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 256
    dim: int = 16


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def _refuse_parallel(cfg: ToyConfig, dims: ParallelDims) -> None:
    if dims.tp > 1:
        raise ConfigError(f"parallel.tp={dims.tp}: the toy family does not shard; set parallel.tp=1")


TOY = ModelFamily(
    name="toy",
    config_cls=ToyConfig,
    presets={"toy": ToyConfig()},
    model_classes=(Toy,),
    build=Toy,
    config_from_run=lambda config: ToyConfig(dim=int(config.model.options.get("dim", 16))),
    check=lambda cfg, config: None,
    validate_parallel=_refuse_parallel,
    param_count=lambda cfg: 2 * cfg.vocab_size * cfg.dim,
    flops_per_token=lambda model, seq_len, inactive: 6.0 * (_count(model) - inactive),
    activation_bytes=lambda cfg, micro, seq: 0,
)
HALF = FamilyExtension("half", "toy", extra_params=lambda cfg, config: 7, inactive_params=lambda m: _count(m) // 2)


class ToyPlugin:
    @hookimpl
    def crosstrain_model_families(self) -> list:
        clash = ModelFamily(**{**TOY.__dict__, "name": "toy2"})  # takes the preset "toy" again: refused
        return [TOY, HALF, clash]


def test_a_plugin_family_is_found_by_its_preset_and_counted_by_its_bundle():
    from crosstrain.recipes.lm import build_model

    pluginmanager.register(ToyPlugin(), name="toy-family")
    try:
        config = load_config(None, ["model.preset=toy", "model.options={dim = 8}"])
        assert gpt_config(config) == ToyConfig(dim=8)
        model = build_model(config)
        assert isinstance(model, Toy) and family_of(model) is TOY
        assert param_count(config) == 2 * 256 * 8 + 7  # the family's count plus the extension's
        assert training_flops_per_token(model, 32) == 6.0 * (_count(model) - _count(model) // 2)
        assert count_flops([("model", model, True)], 32)[1]["model"]["counted"] == (
            "forward + backward: the model's flops_per_token"
        )  # its family's, not 6N
        assert "toy2" not in families()
        assert any("preset 'toy' belongs to family 'toy'" in e.error for e in pluginmanager.load_errors())
        raises_one_line(
            lambda: check_world(load_config(None, ["model.preset=toy", "parallel.tp=2"]), 2),
            "the toy family does not shard",
        )
    finally:
        pluginmanager.unregister("toy-family")
    assert "toy" not in families()


# -- the scalar head of the rm, ppo and reward-model recipes -----------------------------------------------------
def test_scalar_head_draws_what_the_recipes_drew():
    """The same weights and the same RNG stream afterwards as the hand-made swaps it replaced (numerics unchanged)."""
    for init in ("normal", "zeros", "default"):
        torch.manual_seed(3)
        model = swap_scalar_head(build_gpt("tiny"), init, who="--recipe rm")
        after = torch.rand(4)
        torch.manual_seed(3)
        build_gpt("tiny")
        head = nn.Linear(64, 1, bias=False)
        if init == "normal":
            nn.init.normal_(head.weight, std=64**-0.5)
        elif init == "zeros":
            nn.init.zeros_(head.weight)
        torch.testing.assert_close(model.output.weight, head.weight, rtol=0, atol=0)
        assert torch.equal(torch.rand(4), after), init
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 1)


def test_scalar_head_on_a_tied_model_stays_a_scalar_head():
    """Tensor parallelism re-ties weights after sharding (GPT.tie_weights): a swapped head must not be re-tied."""
    model = swap_scalar_head(build_gpt("tiny", tie_embeddings=True), "default", who="reward.model")
    model.tie_weights()
    assert model.output.weight.shape == (1, 64) and model.output.weight is not model.tok_embeddings.weight


def test_scalar_head_refuses_a_model_of_no_family():
    raises_one_line(
        lambda: swap_scalar_head(nn.Linear(2, 2), "normal", who="--recipe rm"),
        "--recipe rm needs the built-in GPT",
        "Linear",
        "model.import_path",
    )
    with pytest.raises(ValueError, match="'xavier'"):
        swap_scalar_head(build_gpt("tiny"), "xavier", who="--recipe rm")
