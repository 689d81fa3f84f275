"""Hugging Face checkpoints in and out: logits against transformers, bit-exact round trips, one-line refusals.

Every model is built here: random-initialised ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``
from tiny configs, saved with ``save_pretrained(safe_serialization=True)``. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.config import load_config  # noqa: E402
from crosstrain.errors import ConfigError  # noqa: E402
from crosstrain.kernels import registry  # noqa: E402
from crosstrain.recipes.lm import build_model, init_from_record  # noqa: E402

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def save_hf(kind: str, folder: Path, **extra: object) -> torch.nn.Module:
    """A random tiny HF model of ``kind`` saved to ``folder``; biases are randomised so they matter."""
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM")}
    cfg_cls, model_cls = (getattr(transformers, n) for n in classes[kind])
    torch.manual_seed(7)
    model = model_cls(cfg_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial biases and norm scales
                p.normal_(0.5 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {"llama": root / "llama", "qwen2": root / "qwen2", "mistral": root / "mistral"}
    save_hf("llama", dirs["llama"])
    save_hf("qwen2", dirs["qwen2"], tie_word_embeddings=True)
    save_hf("mistral", dirs["mistral"], sliding_window=None)
    dirs["sharded"] = root / "sharded"
    model = save_hf("llama", root / "tmp")
    model.save_pretrained(dirs["sharded"], safe_serialization=True, max_shard_size="60KB")
    dirs["bf16"] = root / "bf16"
    model.to(torch.bfloat16).save_pretrained(dirs["bf16"], safe_serialization=True)
    return dirs


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), registry.use_reference():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "sharded"])
def test_init_from_logits_match_transformers(hf_dirs: dict[str, Path], kind: str) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    config = load_config(None, [f"model.init_from={hf_dirs[kind]}"])
    model = build_model(config).eval()
    assert model.config.qkv_bias == (kind == "qwen2")
    assert model.config.tie_embeddings == (kind == "qwen2")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_logits(model, ids), _logits(ref, ids), atol=1e-5, rtol=0)
    record = init_from_record(config, model)
    assert record is not None and record["source"] == str(hf_dirs[kind].resolve()) and len(record["sha256"]) == 64


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from crosstrain.models.hf import iter_tensors

    return dict(iter_tensors(folder))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "sharded", "bf16"])
def test_round_trip_hf_crosstrain_hf_is_bit_exact(hf_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    dtype = "bfloat16" if kind == "bf16" else "float32"
    assert main(["export", str(hf_dirs[kind]), "--format", "hf", "--out", str(out), "--max-shard-size", "60KB",
                 "--dtype", dtype]) == 0
    before, after = _tensors(hf_dirs[kind]), _tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    index = json.loads((out / "model.safetensors.index.json").read_text())  # 60KB shards: always an index
    assert set(index["weight_map"]) == set(before)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in before.values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ("qwen2" if kind == "qwen2" else "llama")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(12).view(1, 12)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    assert torch.equal(_logits(reloaded, ids), _logits(ref, ids))


def test_default_gpt_has_no_biases_and_unchanged_names() -> None:
    from crosstrain.models.gpt import build_gpt

    names = list(build_gpt("tiny").state_dict())
    assert not any(n.endswith(".bias") for n in names)
    assert len(names) == 2 + 2 * 9 + 1  # embeddings, 2 blocks x 9, final norm (output is in the 2)
    biased = build_gpt("tiny", qkv_bias=True)
    assert all(torch.count_nonzero(b.attention.wq.bias) == 0 for b in biased.blocks())


def _write_config(folder: Path, **changes: object) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(("kind", "changes", "field"), [
    ("llama", {"rope_scaling": {"rope_type": "proportional", "factor": 8.0}, "rope_parameters": None}, "rope_scaling"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"]}, "layer_types"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"model_type": "gpt2"}, "model_type='gpt2'"),
])
def test_unsupported_options_are_one_line_errors(
    hf_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
    changes: dict[str, object], field: str,
) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(hf_dirs[kind], folder)
    _write_config(folder, **changes)
    # another model_type goes to the generic path under model.source=auto; the native path refuses it
    sets = [f"model.init_from={folder}", *(["model.source=native"] if "model_type" in changes else [])]
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")):
        build_model(load_config(None, sets))
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1


def test_pickle_only_and_shape_overrides_are_refused(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickle"):
        build_model(load_config(None, [f"model.init_from={folder}"]))
    with pytest.raises(ConfigError, match="model.dim cannot be combined with model.init_from"):
        load_config(None, [f"model.init_from={hf_dirs['llama']}", "model.dim=32"])


def test_trained_tiny_exports_to_transformers_with_same_logits_and_greedy_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Acceptance: train the tiny preset, export --format hf, load with AutoModel/AutoTokenizer."""
    from crosstrain.engine import Trainer
    from crosstrain.plugins.export.loading import load_model

    run = tmp_path / "run"
    overrides = ["logging.progress=none", "train.steps=10", "train.seq_len=64", "train.batch_size=8",
                 "checkpoint.every=10", "eval.every=0"]
    Trainer(load_config(None, overrides), run_dir=run).fit()
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = "Ada found the lantern"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(prompt.encode())
    ours = load_model(run).model
    assert torch.allclose(_logits(hf, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "32", "--json"]) == 0
    new_ids = json.loads(capsys.readouterr().out)["new_ids"]
    with torch.no_grad():
        greedy = hf.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
    assert greedy[0, ids.shape[1]:].tolist() == new_ids and len(new_ids) == 32
    assert main(["generate", str(out), "--prompt", prompt, "--max-new-tokens", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_ids"] == new_ids


def test_onnx_export_from_hf_folder_keeps_qkv_biases(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The ONNX path reads HF folders through the same adapter (its parity check covers the biases)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "m.onnx"
    assert main(["export", str(hf_dirs["qwen2"]), "--format", "onnx", "--out", str(out), "--json"]) == 0
    assert out.is_file()


def test_dropout_the_native_model_does_not_apply_is_one_warning(tmp_path: Path) -> None:
    """A config.json asking for dropout: training natively says in one warning line that it is not applied (and how
    to train with it); the generic path (transformers' own modules, which apply it) says nothing."""
    save_hf("llama", tmp_path / "dropout", attention_dropout=0.1)
    base = ["train", "--set", f"model.init_from={tmp_path / 'dropout'}", "--set", "train.steps=1", "--set",
            "train.batch_size=2", "--set", "train.seq_len=16", "--set", "eval.every=0", "--set",
            "logging.progress=none", "--set", "checkpoint.final=false"]
    import warnings

    from crosstrain.errors import CrosstrainWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*base, "--run-dir", str(tmp_path / "native")]) == 0
    warned = [str(w.message) for w in caught
              if issubclass(w.category, CrosstrainWarning) and "dropout" in str(w.message)]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "attention_dropout=0.1 not applied" in warned[0] and "model.source=transformers" in warned[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*base, "--set", "model.source=transformers", "--run-dir", str(tmp_path / "generic")]) == 0
    assert not [w for w in caught if "dropout" in str(w.message)]
