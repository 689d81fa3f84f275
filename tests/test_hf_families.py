"""The native Hugging Face families of issue 29 against transformers 5: Llama 3 rope scaling (llama3, linear, dynamic,
yarn) with ``attention_bias``/``mlp_bias``, Qwen3 (q/k norm per head, explicit ``head_dim``), Phi-3 (fused qkv and
gate_up, partial rotary, longrope), OLMo 2 (post-norms, q/k norm over the projection) and SmolLM3 (NoPE layers).

Per family: a tiny random transformers model (biases and norms moved off their init values) saved sharded; fp32
logits within 1e-5, greedy 32 tokens equal to ``generate`` (the CLI for Phi-3), HF -> crosstrain -> HF bit-exact, and
1 vs 2 ranks (``dp_shard=2`` and ``tp=2``, logits and every gradient) within 1e-5 in one spawned group.
Closed-form checks of the rope formulas (crosstrain.models.rope) come first.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch

transformers = pytest.importorskip("transformers")

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.config import load_config  # noqa: E402
from crosstrain.errors import ConfigError  # noqa: E402
from crosstrain.models import rope  # noqa: E402
from crosstrain.recipes.lm import build_model  # noqa: E402

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.2 * i for i in range(6)],
            "long_factor": [3.0 + 0.2 * i for i in range(6)]}
#: family -> (transformers class prefix, config fields, crosstrain model_type on export)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("Llama", {"rope_parameters": LLAMA3, "attention_bias": True, "mlp_bias": True}),
    "yarn": ("Llama", {"rope_parameters": YARN, "head_dim": 24}),
    "qwen3": ("Qwen3", {"head_dim": 24, "attention_bias": True}),
    "phi3": ("Phi3", {"partial_rotary_factor": 0.75, "max_position_embeddings": 256,
                      "original_max_position_embeddings": 64, "rope_parameters": LONGROPE}),
    "olmo2": ("Olmo2", {"attention_bias": True}),
    "smollm3": ("SmolLM3", {"no_rope_layer_interval": 2, "mlp_bias": True}),
}
PROMPT = [3, 17, 250, 9, 41, 77, 5]


def save_family(family: str, folder: Path, **overrides: Any) -> torch.nn.Module:
    """A random tiny transformers model of ``family`` saved sharded; biases and norm scales randomised."""
    prefix, extra = FAMILIES[family]
    cfg = getattr(transformers, f"{prefix}Config")(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(11)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.5 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = root / family
        save_family(family, dirs[family])
        assert (dirs[family] / "model.safetensors.index.json").is_file()  # saved sharded
    return dirs


# -- rope formulas in closed form ------------------------------------------------------------------------------
def test_rope_inverse_frequencies_match_their_closed_forms() -> None:
    dim, theta = 16, 10000.0
    plain = [theta ** (-2 * i / dim) for i in range(dim // 2)]
    assert torch.allclose(rope.default_inv_freq(dim, theta), torch.tensor(plain), rtol=1e-6, atol=0)
    assert torch.allclose(rope.linear_inv_freq(dim, theta, 4.0), torch.tensor(plain) / 4, rtol=1e-6, atol=0)
    # dynamic NTK: the plain base up to max_position; at 2x with factor 2 the base is theta * 3^(dim/(dim-2))
    assert torch.equal(rope.dynamic_inv_freq(dim, theta, 2.0, 64, 128), rope.default_inv_freq(dim, theta))
    base = theta * 3.0 ** (dim / (dim - 2))
    assert torch.allclose(rope.dynamic_inv_freq(dim, theta, 2.0, 256, 128),
                          torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)]), rtol=1e-6, atol=0)
    # llama3: short wavelengths kept, long ones divided by factor, the band between interpolated
    got = rope.llama3_inv_freq(dim, theta, 8.0, 1.0, 4.0, 32)
    for i, f in enumerate(plain):
        wavelen = 2 * math.pi / f
        if wavelen < 32 / 4:
            want = f
        elif wavelen > 32 / 1:
            want = f / 8
        else:
            s = (32 / wavelen - 1) / (4 - 1)
            want = (1 - s) * f / 8 + s * f
        assert math.isclose(float(got[i]), want, rel_tol=1e-6), i
    # yarn: temperature 0.1 ln(s) + 1; dims past the ramp interpolated (/ factor), dims before it kept
    inv, scale = rope.yarn_parameters(dim, theta, {"factor": 4.0, "original_max_position_embeddings": 32})
    assert math.isclose(scale, 0.1 * math.log(4.0) + 1)
    assert math.isclose(float(inv[0]), plain[0], rel_tol=1e-6)
    assert math.isclose(float(inv[-1]), plain[-1] / 4, rel_tol=1e-6)
    # longrope: 1 / (short_i theta^(2i/d)), temperature sqrt(1 + ln(factor) / ln(original))
    short = [1.0 + i for i in range(dim // 2)]
    inv, scale = rope.longrope_parameters(dim, theta, {"factor": 4.0, "original_max_position_embeddings": 64,
                                                       "short_factor": short})
    assert torch.allclose(inv, torch.tensor([f / s for f, s in zip(plain, short, strict=True)]), rtol=1e-6, atol=0)
    assert math.isclose(scale, math.sqrt(1 + math.log(4.0) / math.log(64)))
    cos, sin = rope.rope_tables(dim, 8, theta, {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32})
    assert torch.allclose(cos[0], torch.full((dim // 2,), 0.1 * math.log(4.0) + 1)) and torch.all(sin[0] == 0)


@pytest.mark.parametrize("params", [
    LLAMA3, YARN, {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}, {"rope_type": "dynamic", "rope_theta": 1e4,
                                                                     "factor": 3.0},
], ids=["llama3", "yarn", "yarn_mscale", "linear", "dynamic"])
def test_rope_tables_equal_transformers_rotary_embedding(params: dict[str, Any]) -> None:
    """The GPT's imported rope table against transformers' LlamaRotaryEmbedding (cos and sin, bit for bit)."""
    from crosstrain.models.hf import gpt_config_from_hf
    from crosstrain.models.rope import rope_tables

    hf_cfg = transformers.LlamaConfig(**SHAPE, rope_parameters=dict(params))
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    positions = torch.arange(128).unsqueeze(0)
    want_cos, want_sin = emb(torch.zeros(1, dtype=torch.float32), positions)
    cfg = gpt_config_from_hf(hf_cfg.to_dict())
    cos, sin = rope_tables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(torch.cat((cos, cos), -1), want_cos[0]) and torch.equal(torch.cat((sin, sin), -1), want_sin[0])


# -- each family against transformers --------------------------------------------------------------------------
def _ours(folder: Path) -> torch.nn.Module:
    return build_model(load_config(None, [f"model.init_from={folder}", "train.seq_len=32"])).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(hf_dirs: dict[str, Path], family: str) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).eval()
    model = _ours(hf_dirs[family])
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-5, f"{family}: max |logits diff| {diff}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_32_tokens_equal_transformers_generate(
    hf_dirs: dict[str, Path], family: str, capsys: pytest.CaptureFixture[str],
) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids),
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    if family == "phi3":  # the CLI once: fused weights, partial rotary and longrope through `crosstrain generate`
        capsys.readouterr()
        assert main(["generate", str(hf_dirs[family]), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-new-tokens", "32", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["new_ids"]
    else:
        from crosstrain.generation import GenerationConfig, generate

        got = generate(_ours(hf_dirs[family]), [PROMPT], GenerationConfig(max_new_tokens=32, greedy=True))
        got = got.tokens[0].tolist()
    assert got == want and len(got) == 32


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from crosstrain.models.hf import iter_tensors

    return dict(iter_tensors(folder))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_crosstrain_hf_is_bit_exact(hf_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    out = tmp_path / "out"
    assert main(["export", str(hf_dirs[family]), "--format", "hf", "--out", str(out), "--max-shard-size",
                 "100KB"]) == 0
    before, after = _tensors(hf_dirs[family]), _tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (hf_dirs[family], out))
    for key in ("model_type", "max_position_embeddings", "head_dim", "attention_bias", "no_rope_layers"):
        assert key not in src_cfg or out_cfg[key] == src_cfg[key], key
    ids = torch.arange(40).view(1, 40)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[family]).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize(("family", "expected"), [("llama3", "llama"), ("qwen3", "qwen3"), ("phi3", "phi3"),
                                                  ("olmo2", "olmo2"), ("smollm3", "smollm3")])
def test_export_without_a_base_config_picks_the_family_that_computes_it(
    hf_dirs: dict[str, Path], family: str, expected: str,
) -> None:
    """A model whose import config is gone (a crosstrain checkpoint) exports as a family transformers runs the same."""
    from crosstrain.models.hf import hf_config_from_gpt, pretrained_config

    cfg = pretrained_config(hf_dirs[family])
    out = hf_config_from_gpt(cfg)
    assert out["model_type"] == expected
    from crosstrain.models.hf import gpt_config_from_hf

    assert gpt_config_from_hf(out) == cfg


def test_v4_rope_scaling_is_read_like_v5_rope_parameters(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A Llama 3.1-style config.json of transformers 4 (``rope_scaling`` + top-level ``rope_theta``) gives the same
    model as the v5 ``rope_parameters`` one, and the logits transformers computes from it."""
    folder = tmp_path / "v4"
    shutil.copytree(hf_dirs["llama3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    cfg.update({"rope_scaling": scaling, "rope_theta": LLAMA3["rope_theta"]})
    cfg.pop("rope_parameters")
    (folder / "config.json").write_text(json.dumps(cfg))
    ours = _ours(folder)
    assert ours.config == _ours(hf_dirs["llama3"]).config
    ids = torch.arange(48).view(1, 48)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        assert (ours(ids) - ref).abs().max().item() <= 1e-5


def test_flops_count_the_attention_width_not_the_hidden_size(hf_dirs: dict[str, Path]) -> None:
    """PaLM's 6N + 12 L (heads * head_dim) T: Qwen3's heads are 4 x 24 = 96 wide on a 64-wide residual stream."""
    from crosstrain.models.gpt import GPT
    from crosstrain.models.hf import pretrained_config

    cfg = pretrained_config(hf_dirs["qwen3"])
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    assert model.flops_per_token(32) == 6 * n + 12 * 2 * 96 * 32


# -- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "changes", "field"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["local", "global"]}, "layer_types"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "rope_parameters.low_freq_factor"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("phi3", {"rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.3}}, "partial_rotary_factor"),
])
def test_remaining_refusals_are_one_line(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str,
    changes: dict[str, Any], field: str,
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(hf_dirs[family], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        build_model(load_config(None, [f"model.init_from={folder}"]))
    assert main(["train", "--set", f"model.init_from={folder}"]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1


def test_sequence_dependent_rope_is_refused_past_its_original_context(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """longrope (and dynamic) rescale with the current length in transformers: the table is exact up to the
    original context, which the import takes as max_seq_len; a longer one is refused naming rope_type."""
    assert _ours(hf_dirs["phi3"]).config.max_seq_len == 64
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='longrope'"):
        load_config(None, [f"model.init_from={hf_dirs['phi3']}", "model.max_seq_len=128"])
    folder = tmp_path / "dynamic"
    shutil.copytree(hf_dirs["llama3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_config(None, [f"model.init_from={folder}", "model.max_seq_len=128"])  # max_position_embeddings
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='dynamic'"):
        load_config(None, [f"model.init_from={folder}", "model.max_seq_len=256"])


# -- 1 vs 2 ranks ----------------------------------------------------------------------------------------------
def _layouts(collective: Any, dirs: dict[str, str]) -> dict[str, dict[str, float]]:
    """On each rank: every family unsharded, then FSDP2 over 2 ranks and TP over 2, same tokens; the largest
    logits and gradient differences."""
    from crosstrain.models.hf import load_pretrained
    from crosstrain.parallel import ParallelDims, build_mesh, parallelize

    ids = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
        return logits.detach(), grads

    out: dict[str, dict[str, float]] = {}
    for family, folder in dirs.items():
        want_logits, want_grads = run(load_pretrained(folder))
        for layout, kw in (("dp_shard", {"dp_shard": 2}), ("tp", {"dp_shard": 1, "tp": 2})):
            dims = ParallelDims(world_size=2, **kw).resolve()
            pm = parallelize(load_pretrained(folder), dims, build_mesh(collective, dims), torch.device("cpu"),
                             precision="fp32")
            logits, grads = run(pm.module)
            assert set(grads) == set(want_grads), family
            if layout == "tp":  # really sharded: half the q rows per rank, q/k norms DTensors too where present
                from torch.distributed.tensor import DTensor

                wq = pm.module.get_parameter("layers.0.attention.wq.weight")
                assert isinstance(wq, DTensor) and 2 * wq.to_local().shape[0] == wq.shape[0], family
                norms = [p for n, p in pm.module.named_parameters() if "q_norm" in n]
                assert all(isinstance(p, DTensor) for p in norms), family
            out[f"{family}/{layout}"] = {
                "logits": float((logits - want_logits).abs().max()),
                "grads": max(float((grads[n] - want_grads[n]).abs().max()) for n in grads),
            }
    return out


def test_dp_shard_and_tp_match_one_process(hf_dirs: dict[str, Path]) -> None:
    rank0, rank1 = shared_ranks.run(_layouts, {k: str(v) for k, v in hf_dirs.items()}, timeout=300)
    assert rank0.keys() == rank1.keys() and len(rank0) == 2 * len(FAMILIES)
    for result in (rank0, rank1):
        for case, diff in result.items():
            assert diff["logits"] <= 1e-5 and diff["grads"] <= 1e-5, f"{case}: {diff}"
