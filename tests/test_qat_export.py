"""``crosstrain export --quantize`` (issue 30): the integer ONNX model of a QAT run runs in onnxruntime and matches
the fake-quantised PyTorch model; the Hugging Face folder holds the dequantised weights; bad flags are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from in_process import crosstrain_main
from one_line import one_line_error

from crosstrain.plugins.compress.qat.fake_quant import fake_quant_weight

SCHEME = "int8-act-int4-weight"
TRAIN = ["train", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "logging.progress=none",
         "--set", "logging.tensorboard=false", "--set", "backend=cpu", "--set", "train.steps=3",
         "--set", "eval.every=0", "--set", "model.n_layers=1", "--set", f"quant.qat={SCHEME}",
         "--set", "quant.group_size=32"]


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("qat") / "run"
    assert crosstrain_main([*TRAIN, "--run-dir", str(run)]) == 0
    return run


def test_quantized_onnx_runs_in_onnxruntime_like_the_fake_quantised_model(qat_run, tmp_path, capsys) -> None:
    import onnx
    from onnx import TensorProto

    from crosstrain.kernels import registry
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.export.runtime import make_session

    out = tmp_path / "model.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(qat_run), "--quantize", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["scheme"] == SCHEME and report["ptq"] is False and report["layers"] == 8  # 7 in the block + output
    assert report["parity"]["passed"] and report["parity"]["max_abs_err"] <= 1e-4
    graph = onnx.load(str(out)).graph
    int4 = [i for i in graph.initializer if i.data_type == TensorProto.INT4]
    floats = [i.name for i in graph.initializer
              if i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and not i.name.endswith(".scale")]
    assert len(int4) == 8 and sum(n.op_type == "DequantizeLinear" for n in graph.node) == 8
    assert sorted(floats) == ["gpt.rope_cos", "gpt.rope_sin", "gpt.tok_embeddings.weight"]  # no fp32 linear left

    # independently of the export's own gate: the run's weights, fake-quantised as trained, against onnxruntime
    model = load_model(qat_run).model
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with registry.use_reference(), torch.no_grad():
        want = model(ids).numpy()
    cfg = model.config
    feeds = {"input_ids": ids.numpy()}
    for i in range(cfg.n_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((2, cfg.kv_heads, 0, cfg.head_dim), np.float32)
    got = make_session(out).run(None, feeds)[0]
    assert float(np.abs(got - want).max()) <= 1e-4


def test_hf_folder_holds_the_dequantised_weights(qat_run, tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from crosstrain.checkpoint.consolidate import load_consolidated
    from crosstrain.checkpoint.resolve import resolve_path

    out = tmp_path / "hf"
    assert crosstrain_main(["export", str(qat_run), "--format", "hf", "--quantize", "--out", str(out)]) == 0
    trained = load_consolidated(resolve_path(qat_run))
    trained = {k.split("model.", 1)[-1]: v for k, v in trained.items()}
    q_proj = AutoModelForCausalLM.from_pretrained(out).model.layers[0].self_attn.q_proj.weight.detach()
    want = fake_quant_weight(trained["layers.0.attention.wq.weight"].float(), 4, 32)
    assert torch.equal(q_proj, want) and not torch.equal(want, trained["layers.0.attention.wq.weight"].float())
    assert torch.equal(load_file(out / "model.safetensors")["model.embed_tokens.weight"],
                       trained["tok_embeddings.weight"].float())  # embeddings are not quantised


@pytest.mark.parametrize("flags,needle", [
    (["--ptq", "int8"], "was trained with QAT"),
    (["--quantize", "int8"], "drop the scheme"),
    (["--quantize", "--format", "safetensors"], "--format onnx (integer weights) or hf"),
    (["--quantize", "--ptq", "int8"], "pass one"),
    (["--quantize", "int4"], "invalid choice"),
])
def test_bad_quantize_flags_one_line(qat_run, tmp_path, flags, needle, capsys) -> None:
    out = tmp_path / "x.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(qat_run), *flags, "--out", str(out)]) == 2
    o, e = capsys.readouterr()
    assert needle in (e.strip().splitlines()[-1] if "invalid choice" in needle else one_line_error(o, e)[-1])
    assert not out.exists() and not list(tmp_path.iterdir())
