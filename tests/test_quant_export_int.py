"""The integer ONNX export (issue 40): each integer node computes what its PyTorch reference says (op by op, from the
rewriter's own graph), every scheme passes its derived parity gate on 8 random batches, the gate fails against a
wrong reference, and its errors name the flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from in_process import crosstrain_main
from one_line import one_line_error

from crosstrain.plugins.compress.qat.fake_quant import dequantize_weight, quantize_weight
from crosstrain.plugins.compress.qat.onnx_weights import IntEmbedding, IntWeight, integer_graph
from crosstrain.plugins.export.int_reference import OrtIntLinear, dynamic_quantize_linear, matmul_integer

TRAIN = ["train", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "logging.progress=none",
         "--set", "logging.tensorboard=false", "--set", "backend=cpu", "--set", "train.steps=3",
         "--set", "eval.every=0", "--set", "model.n_layers=1"]


def _one_matmul_graph(w: torch.Tensor, k: int) -> object:
    """``y = x @ W^T`` as the exporter writes a linear layer: MatMul on a folded ``W^T`` initializer."""
    from onnx import TensorProto, helper, numpy_helper

    init = numpy_helper.from_array(np.ascontiguousarray(w.numpy().T), "w_t")
    node = helper.make_node("MatMul", ["x", "w_t"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("bits,group", [(8, 0), (4, 32), (4, 16), (8, 32)])
def test_each_integer_node_computes_its_reference(bits, group, tmp_path) -> None:
    from crosstrain.plugins.export.runtime import make_session

    k, n = 128, 48
    gen = torch.Generator().manual_seed(bits + group)
    q, s = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, bits, group or k)
    dq = dequantize_weight(q, s)
    model = _one_matmul_graph(dq, k)
    assert integer_graph(model, [IntWeight("lin", q, s, bits, dq)]) == 1
    path = tmp_path / "m.onnx"
    import onnx

    onnx.save(model, str(path))
    session = make_session(path, threads=1)
    kind = "matmul_integer" if group == 0 else "matmul_nbits"
    ref = OrtIntLinear(kind, q, s, None, group or k)
    for shape in [(1, 1), (1, 7), (3, 33)]:
        x = torch.randn(*shape, k, generator=gen) * 3
        x[..., 5] *= 20  # one outlier channel sets the grid
        got = session.run(None, {"x": x.numpy()})[0]
        want = ref(x).numpy()
        if kind == "matmul_integer":  # exact integer sums on both sides: bit-identical
            assert np.array_equal(got, want)
        else:  # the blocks summed in another fp32 order: a few ulp
            assert float(np.abs(got - want).max()) <= 4e-6 * float(np.abs(want).max())


def test_dynamic_quantize_linear_is_onnxs() -> None:
    """The ONNX spec's DynamicQuantizeLinear example (onnx/backend/test/case/node/dynamicquantizelinear.py)."""
    x = torch.tensor([0.0, 2.0, -3.0, -2.5, 1.34, 0.5])
    q, s, z = dynamic_quantize_linear(x)
    assert float(s) == pytest.approx(np.float32(5.0 / 255.0)) and int(z) == 153
    assert q.tolist() == [153, 255, 0, 26, 221, 179]
    assert matmul_integer(x.reshape(1, 6), torch.eye(6, dtype=torch.int8), torch.ones(6)).shape == (1, 6)


def test_tied_embedding_and_head_share_the_int8_table(tmp_path) -> None:
    """A tied head computes with the embedding's int8 bytes through MatMulNBits (8 bits), one table in the file."""
    import onnx

    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.export.int_model import quantize_embedding
    from crosstrain.plugins.export.loading import LoadedModel, tokenizer_metadata

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=1, tie_embeddings=True).eval()
    from crosstrain.plugins.compress.qat.export import export_quantized_onnx
    from crosstrain.plugins.compress.qat.schemes import scheme

    loaded = LoadedModel(model, model.config, tokenizer_metadata(model.config), "random tiny")
    report = export_quantized_onnx(loaded, tmp_path / "m.onnx", scheme("int8"), ptq=True)
    assert report.parity.passed and report.parity.batches == 8 and report.layers == 8  # 7 + the tied head
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    tables = [i for i in graph.initializer if i.name.endswith(".u8")]
    assert len(tables) == 1 and tables[0].data_type == onnx.TensorProto.UINT8
    users = [n.op_type for n in graph.node if tables[0].name in n.input]
    assert sorted(users) == ["Gather", "MatMulNBits"]
    emb = quantize_embedding(build_gpt("tiny", n_layers=1, tie_embeddings=True))
    assert isinstance(emb, IntEmbedding) and emb.head_block == 32


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A floating-point run and an int8 QAT run (3 steps each)."""
    root = tmp_path_factory.mktemp("runs")
    out = {"fp32": root / "fp32", "qat_int8": root / "qat_int8"}
    assert crosstrain_main([*TRAIN, "--run-dir", str(out["fp32"])]) == 0
    assert crosstrain_main([*TRAIN, "--set", "quant.qat=int8", "--run-dir", str(out["qat_int8"])]) == 0
    return out


@pytest.mark.parametrize("run,flags,op", [
    ("fp32", ["--ptq", "int8"], "MatMulInteger"),
    ("fp32", ["--ptq", "int8-act-int4-weight"], "MatMulNBits"),
    ("qat_int8", ["--quantize"], "MatMulInteger"),
])
def test_every_scheme_passes_its_derived_gate_on_8_batches(runs, run, flags, op, tmp_path, capsys) -> None:
    import onnx

    out = tmp_path / "m.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(runs[run]), *flags, "--out", str(out), "--json"]) == 0
    parity = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["parity"]
    assert parity["passed"] and parity["batches"] == 8 and parity["bound"] == "derived", parity
    assert 0 < parity["max_abs_err"] <= parity["tolerance"]
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert op in ops and not {"Round", "Clip", "ReduceMin", "ReduceMax"} & ops
    if op == "MatMulInteger":
        assert "DynamicQuantizeLinear" in ops


def test_the_gate_fails_against_a_wrong_reference(tmp_path) -> None:
    """The gate can fail: a reference that skips activation quantisation (``R = F``, only the fp32 allowance left)
    and one reading the int4 head's nibbles in the other order (a packing bug) are both refused."""
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.compress.qat.convert import integer_model
    from crosstrain.plugins.compress.qat.export import export_quantized_onnx
    from crosstrain.plugins.compress.qat.linear import fake_quant_disabled, quantize_linears
    from crosstrain.plugins.compress.qat.schemes import scheme
    from crosstrain.plugins.export.errors import ParityError
    from crosstrain.plugins.export.int_model import ort_reference, quantize_embedding
    from crosstrain.plugins.export.int_parity import check_integer_parity
    from crosstrain.plugins.export.loading import LoadedModel, tokenizer_metadata

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=1).eval()
    sch = scheme("int8-act-int4-weight", 32)
    loaded = LoadedModel(model, model.config, tokenizer_metadata(model.config), "random tiny")
    path = tmp_path / "m.onnx"
    export_quantized_onnx(loaded, path, sch, ptq=True)
    torch.manual_seed(0)
    fresh = build_gpt("tiny", n_layers=1).eval()
    quantize_linears(fresh, sch)
    converted, weights = integer_model(fresh)
    embedding = quantize_embedding(converted)
    with fake_quant_disabled(converted):
        with pytest.raises(ParityError, match="--quant-tolerance"):
            check_integer_parity(converted, converted, path, label="x")  # no activation quantisation: R = F
        head = next(w for w in weights if w.name == "output")  # the int4 nibbles of the head read in pairs swapped:
        head.q = head.q.reshape(head.q.shape[0], -1, 2).flip(-1).reshape(head.q.shape).contiguous()
        with torch.no_grad():  # R and F both hold the swapped weights; the graph does not
            converted.output.weight.copy_(dequantize_weight(head.q, head.scale))
        with pytest.raises(ParityError, match="--quant-tolerance"):
            check_integer_parity(ort_reference(converted, weights, embedding), converted, path, label="x")


def test_a_failed_gate_names_the_flag_and_writes_nothing(runs, tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(runs["fp32"]), "--ptq", "int8", "--quant-tolerance", "0",
                            "--out", str(out)]) == 7  # a parity failure (docs/export.md)
    line = one_line_error(*capsys.readouterr())[-1]
    assert "--quant-tolerance" in line and "parity check failed" in line
    assert not list(tmp_path.iterdir())


def test_int4_group_without_a_matmulnbits_block_is_one_line(runs, tmp_path, capsys) -> None:
    out = tmp_path / "m.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(runs["fp32"]), "--ptq", "int8-act-int4-weight", "--group-size", "8",
                            "--out", str(out)]) == 2
    assert "power of two >= 16" in one_line_error(*capsys.readouterr())[-1]
    assert not list(tmp_path.iterdir())
