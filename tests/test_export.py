"""Export plugin: ONNX with KV cache vs PyTorch, generation on both engines, int8, safetensors, CLI errors.

One tiny GPT is trained for a few steps and exported once per module (exports take seconds).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from crosstrain.cli.main import main
from crosstrain.models.gpt import build_gpt

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

TEXT = b"the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. "


def train_tiny(steps: int = 40, seed: int = 0) -> tuple[torch.nn.Module, float, float]:
    """A tiny GPT trained a few AdamW steps on a short text; returns (model, first loss, last loss)."""
    torch.manual_seed(seed)
    model = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(list(TEXT * 20))
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,))
        x = torch.stack([data[s : s + 64] for s in starts])
        y = torch.stack([data[s + 1 : s + 65] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses[0], losses[-1]


def save_plain(model: torch.nn.Module, folder: Path) -> Path:
    """A plain safetensors state_dict + a run-style config.json next to it (no crosstrain metadata)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "weights.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    (folder / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}, "train": {"steps": 40}}))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export")
    model, first, last = train_tiny()
    src = save_plain(model, root / "run")
    out = root / "out" / "model.onnx"
    assert main(["export", str(src), "--format", "onnx", "--out", str(out), "--int8"]) == 0
    return {"root": root, "model": model, "src": src, "onnx": out, "int8": out.with_name("model.int8.onnx"),
            "first_loss": first, "last_loss": last}


def test_export_writes_graph_with_kv_cache_and_metadata(exported: dict) -> None:
    import onnx

    from crosstrain.plugins.export.runtime import make_session, read_metadata

    assert exported["last_loss"] < 0.5 * exported["first_loss"]  # the model really learned something
    proto = onnx.load(str(exported["onnx"]))
    props = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(props["crosstrain.gpt_config"]) == exported["model"].config.to_dict()
    assert json.loads(props["crosstrain.tokenizer"])["type"] == "byte"
    sess = make_session(exported["onnx"])
    cfg, tok = read_metadata(sess)
    assert cfg == exported["model"].config and tok["vocab_size"] == 256
    inputs = {i.name: i.shape for i in sess.get_inputs()}
    outputs = {o.name: o.shape for o in sess.get_outputs()}
    assert len(inputs) == 1 + 2 * cfg.n_layers and len(outputs) == 1 + 2 * cfg.n_layers
    batch, seq = inputs["input_ids"]
    assert isinstance(batch, str) and isinstance(seq, str)  # dynamic axes
    k0 = inputs["past_key_values.0.key"]
    assert k0[0] == batch and isinstance(k0[2], str) and k0[1] == cfg.kv_heads and k0[3] == cfg.head_dim
    assert outputs["logits"][-1] == 256 and "present.1.value" in outputs
    # no leftovers of the temp-then-rename protocol
    assert sorted(p.name for p in exported["onnx"].parent.iterdir()) == ["model.int8.onnx", "model.onnx"]


def test_parity_prefill_and_decode_within_fp32_tolerance(exported: dict) -> None:
    from crosstrain.plugins.export.parity import check_parity

    report = check_parity(exported["model"], exported["onnx"], tolerance=1e-4, seed=3, batch=3, prefill_len=17,
                          decode_steps=6)
    assert report.passed and report.max_abs_err <= 1e-4 and report.decode_steps == 6
    assert report.max_abs_err_prefill > 0 or report.max_abs_err_decode > 0  # real comparison, not identity

    # a model that differs from the exported one fails loudly
    from crosstrain.plugins.export.errors import ParityError

    other = build_gpt("tiny").eval()
    with pytest.raises(ParityError, match="parity check failed"):
        check_parity(other, exported["onnx"], tolerance=1e-4)


def test_greedy_64_tokens_identical_onnxruntime_vs_torch(exported: dict) -> None:
    from crosstrain.plugins.export.generate import OrtEngine, TorchEngine, encode, generate

    ort_engine = OrtEngine(exported["onnx"], threads=1)
    torch_engine = TorchEngine(exported["model"])
    prompts = [encode(ort_engine.tokenizer, p) for p in ("the quick b", "pack my box")]
    ort_tokens = generate(ort_engine, prompts, 64)
    torch_tokens = generate(torch_engine, prompts, 64)
    assert ort_tokens == torch_tokens
    assert all(len(t) == 64 for t in ort_tokens)
    # the trained model continues its training text
    assert bytes(ort_tokens[0][:8]).startswith(b"rown fox")


def test_sampled_generation_same_seed_same_tokens(exported: dict) -> None:
    from crosstrain.plugins.export.generate import OrtEngine, Sampling, TorchEngine, generate

    ort_engine = OrtEngine(exported["onnx"])
    torch_engine = TorchEngine(exported["model"])
    prompt = list(b"the lazy")
    s = Sampling(temperature=1.5, top_k=20, top_p=0.95, seed=7)
    a = generate(ort_engine, prompt, 32, s)
    assert a == generate(torch_engine, prompt, 32, s)
    assert a != generate(ort_engine, prompt, 32, Sampling(temperature=1.5, top_k=20, top_p=0.95, seed=8))
    assert a != generate(ort_engine, prompt, 32)  # sampling at T=1.5 is not greedy


def test_generate_cli_both_engines(exported: dict, capsys: pytest.CaptureFixture[str]) -> None:
    outs = {}
    for engine, model in (("onnxruntime", exported["onnx"]), ("torch", exported["src"])):
        rc = main(["generate", str(model), "--prompt", "pack my", "--max-new-tokens", "64", "--engine", engine,
                   "--json"])
        assert rc == 0
        outs[engine] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs["onnxruntime"]["new_ids"] == outs["torch"]["new_ids"]
    assert len(outs["torch"]["new_ids"]) == 64 and outs["torch"]["text"].startswith(" box")


def test_int8_model_is_smaller_and_reports_its_own_parity(exported: dict) -> None:
    from crosstrain.plugins.export.generate import OrtEngine, TorchEngine, generate
    from crosstrain.plugins.export.parity import check_parity

    assert exported["int8"].stat().st_size < 0.7 * exported["onnx"].stat().st_size
    report = check_parity(exported["model"], exported["int8"], tolerance=1e-4, raise_on_fail=False, label="int8")
    assert not report.passed and 1e-4 < report.max_abs_err < 1.0  # lossy, but close
    ids_q = generate(OrtEngine(exported["int8"]), list(b"the quick b"), 16)[0]
    ids_t = generate(TorchEngine(exported["model"]), list(b"the quick b"), 16)[0]
    assert sum(a == b for a, b in zip(ids_q, ids_t)) >= 12


def test_safetensors_export_roundtrip(exported: dict, tmp_path: Path) -> None:
    from crosstrain.plugins.export.loading import load_model

    out = tmp_path / "m.safetensors"
    assert main(["export", str(exported["src"]), "--format", "safetensors", "--out", str(out)]) == 0
    loaded = load_model(out)  # self-describing: config + tokenizer in the safetensors metadata
    assert loaded.config == exported["model"].config and loaded.tokenizer["type"] == "byte"
    ref = exported["model"].state_dict()
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [ln for ln in err if ln.startswith("crosstrain: error:")]
    assert len(err) == 1, err
    return err[0]


def test_missing_checkpoint_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.onnx"
    assert main(["export", str(tmp_path / "nope"), "--out", str(out)]) != 0
    assert "does not exist" in _one_line_error(capsys)
    empty_run = tmp_path / "run"
    (empty_run / "checkpoints").mkdir(parents=True)
    assert main(["export", str(empty_run), "--out", str(out)]) != 0
    assert "no complete checkpoint" in _one_line_error(capsys) or "no checkpoint" in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nope", "run"][1:]


def test_unsupported_model_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(tmp_path / "mlp.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}}))
    out = tmp_path / "mlp.onnx"
    assert main(["export", str(tmp_path / "mlp.safetensors"), "--out", str(out)]) == 6
    assert "only the built-in GPT can be exported" in _one_line_error(capsys)
    (tmp_path / "config.json").write_text(json.dumps({"model": {"import_path": "pkg.mod:build"}}))
    assert main(["export", str(tmp_path / "mlp.safetensors"), "--out", str(out)]) == 6
    assert "user model" in _one_line_error(capsys)
    assert not out.exists()


def test_context_too_long_is_one_line_error(exported: dict, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", str(exported["onnx"]), "--prompt", "x" * 200, "--max-new-tokens", "64"])
    assert rc != 0
    line = _one_line_error(capsys)
    assert re.search(r"264 exceeds the model's max_seq_len 256", line)


def test_parity_failure_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An impossible tolerance makes the (real) parity check fail: one-line error, no file, no temp leftovers."""
    torch.manual_seed(1)
    small = build_gpt("tiny", n_layers=1, dim=32, n_heads=2).eval()
    src = save_plain(small, tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model": {"preset": "tiny", "n_layers": 1, "dim": 32,
                                                                         "n_heads": 2}}))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc = main(["export", str(src), "--out", str(out_dir / "strict.onnx"), "--tolerance", "1e-12"])
    assert rc == 7
    assert "parity check failed" in _one_line_error(capsys)
    assert list(out_dir.iterdir()) == []


def test_plugin_hooks_registered() -> None:
    from crosstrain import pluginmanager
    from crosstrain.cli.main import build_parser

    sections = dict(pluginmanager.call_each("crosstrain_config_sections"))
    assert "export" in sections["export"]
    section = sections["export"]["export"](onnx=True)
    assert section.onnx and section.tolerance == 1e-4
    with pytest.raises(ValueError):
        sections["export"]["export"](onnxx=True)
    text = build_parser().format_help()
    assert "export" in text and "generate" in text


def test_plugins_never_name_device_apis() -> None:
    root = Path(__file__).resolve().parents[1] / "plugins" / "export"
    forbidden = re.compile(r"torch\.cuda|\.cuda\(|torch_npu|torch\.npu|nccl|hccl|crosstrain\.backends", re.I)
    hits = [f"{p.name}:{m.group(0)}" for p in root.rglob("*.py") for m in forbidden.finditer(p.read_text())]
    assert hits == []


def test_onnx_handles_batches_and_long_decode(exported: dict) -> None:
    """A batch of 4 with a 100-token prompt then 50 decode steps: logits stay within tolerance all the way."""
    from crosstrain.plugins.export.generate import OrtEngine, TorchEngine

    ort_engine, torch_engine = OrtEngine(exported["onnx"]), TorchEngine(exported["model"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (4, 100))
    oc, tc = ort_engine.empty_cache(4), torch_engine.empty_cache(4)
    worst = 0.0
    for _ in range(50):
        lo, oc = ort_engine.forward(ids, oc)
        lt, tc = torch_engine.forward(ids, tc)
        worst = max(worst, float(np.abs(lo - lt).max()))
        ids = rng.integers(0, 256, (4, 1))
    assert oc[0].shape == (4, 4, 149, 16)
    assert worst < 1e-4
