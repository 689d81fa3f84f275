"""``crosstrain export --quantize`` (issue 30): the integer ONNX model of a QAT run runs in onnxruntime and matches
the fake-quantised PyTorch model; the Hugging Face folder holds the dequantised weights; bad flags are one line."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_quantized_onnx_computes_in_integers_and_passes_its_gate(qat_run, tmp_path, capsys) -> None:
    import onnx
    from onnx import TensorProto, helper

    out = tmp_path / "model.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(qat_run), "--quantize", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["scheme"] == SCHEME and report["ptq"] is False and report["layers"] == 8  # 7 in the block + output
    parity = report["parity"]
    assert parity["passed"] and parity["batches"] == 8 and parity["bound"] == "derived"
    assert parity["max_abs_err"] <= parity["tolerance"]
    graph = onnx.load(str(out)).graph
    ops = [n.op_type for n in graph.node]
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert len(nbits) == 8 and all(a["accuracy_level"] == 4 and a["bits"] == 4 and a["block_size"] == 32 for a in attrs)
    assert not {"Round", "Clip", "ReduceMin", "ReduceMax", "DequantizeLinear"} & set(ops)  # no fake quantisation
    inits = {i.name for i in graph.initializer}
    assert not [n for n in graph.node if n.op_type == "MatMul" and set(n.input) & inits]  # no float weight matmul
    floats = [i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT and len(i.dims) == 2
              and not i.name.endswith("scale")]
    assert sorted(floats) == ["gpt.rope_cos", "gpt.rope_sin"]  # no fp32 linear or embedding left


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
