"""QAT int8 of a conv classifier: ``quant.qat = "int8"`` on ``--recipe classify`` fake-quantises every Conv2d and
Linear bit for bit as PyTorch's own eager-mode QAT modules do (torch.ao.nn.qat.Conv2d + torch.ao fake quantisers),
the run trains and reloads with its learned ranges, and ``crosstrain export --quantize`` writes an onnxruntime int8
model (QLinearConv/QGemm) storing exactly the trained integers and scales, within the derived bound of the
fake-quantised model. A scheme the conv path lacks, EMA with QAT and the wrong export flag are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from in_process import crosstrain_main
from one_line import one_line_error
from torch import nn

pytest.importorskip("sklearn")
pytest.importorskip("onnxruntime")

STEPS = 150
RUN = ["logging.progress=none", "backend=cpu", "eval.max_batches=0", f"eval.every={STEPS}", f"checkpoint.every={STEPS}"]


def _argv(run: Path, *sets: str) -> list[str]:
    argv = ["train", "--recipe", "classify", "--run-dir", str(run)]
    for s in sets:
        argv += ["--set", s]
    return argv


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("classify_qat") / "run"
    assert crosstrain_main(_argv(out, *RUN, f"train.steps={STEPS}", "quant.qat=int8")) == 0
    return out


def _reference(conv: nn.Conv2d) -> nn.Sequential:
    """torch.ao's own QAT conv (weight fake quant) between torch.ao activation fake quantisers, same qconfig."""
    from torch.ao.nn.qat import Conv2d as QatConv2d
    from torch.ao.quantization import QConfig
    from torch.ao.quantization.fake_quantize import FakeQuantize, default_fused_act_fake_quant
    from torch.ao.quantization.observer import MovingAveragePerChannelMinMaxObserver

    weight = FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-127, quant_max=127,
                                    dtype=torch.qint8, qscheme=torch.per_channel_symmetric, eps=2**-12)
    conv.qconfig = QConfig(activation=default_fused_act_fake_quant, weight=weight)  # type: ignore[assignment]
    return nn.Sequential(default_fused_act_fake_quant(), QatConv2d.from_float(conv), default_fused_act_fake_quant())


def test_conv_fake_quant_is_torch_ao_qat_bit_for_bit() -> None:
    """Three training steps (ranges observed), then eval (ranges frozen): outputs and gradients equal torch.ao's
    modules exactly, and the first step's scales are the closed forms max|w_c| / 127 and (max - min(x, 0)) / 255."""
    from crosstrain.plugins.compress.qat.conv import FakeQuantConv2d, quantize_convnet
    from crosstrain.plugins.compress.qat.schemes import scheme

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1, bias=True)
    with torch.no_grad():
        conv.weight[0] = conv.weight[0].abs()  # a channel of one sign (the fused torch.ao quantiser's zero point -127)
    ref = _reference(nn.Conv2d(3, 8, 3, padding=1, bias=True))
    ref[1].load_state_dict(conv.state_dict(), strict=False)
    model = nn.Sequential(conv)
    assert quantize_convnet(model, scheme("int8")) == ["0"] and type(conv) is FakeQuantConv2d
    for step in range(3):
        x = torch.randn(4, 3, 8, 8) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = conv(xa), ref(xb)
        assert torch.equal(ya, yb)
        if step == 0:
            assert torch.equal(conv.weight_fake_quant.scale, conv.weight.detach().abs().amax((1, 2, 3)) / 127)
            assert not conv.weight_fake_quant.zero_point.any()  # channel 0 is all positive: still symmetric
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            assert conv.input_fake_quant.scale.item() == pytest.approx((hi - lo) / 255, rel=1e-6)
        (ya * torch.arange(ya.numel()).reshape(ya.shape)).sum().backward()
        (yb * torch.arange(yb.numel()).reshape(yb.shape)).sum().backward()
        assert torch.equal(xa.grad, xb.grad) and torch.equal(conv.weight.grad, ref[1].weight.grad)
        with torch.no_grad():  # the same SGD step on both
            for p, q in ((conv.weight, ref[1].weight), (conv.bias, ref[1].bias)):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    model.eval()
    frozen = {k: v.clone() for k, v in conv.state_dict().items()}
    conv(torch.randn(4, 3, 8, 8) * 50)  # a wider input in eval: the ranges do not move
    assert all(torch.equal(v, conv.state_dict()[k]) for k, v in frozen.items())


def test_conv_path_refuses_int4_and_batchnorm_in_one_line() -> None:
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.compress.qat.conv import quantize_convnet
    from crosstrain.plugins.compress.qat.schemes import scheme

    for model, s, words in ((nn.Sequential(nn.Conv2d(1, 2, 3)), "int8-act-int4-weight", 'quant.qat="int8"'),
                            (nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), "int8", "fuse_modules_qat")):
        with pytest.raises(ConfigError, match=words) as err:
            quantize_convnet(model, scheme(s))
        assert "\n" not in str(err.value) and type(model[0]) is nn.Conv2d  # nothing converted


def test_qat_run_trains_reloads_and_reports_the_float_loss(run) -> None:
    """The run learns under int8 rounding, records ``eval/fp/loss`` beside it, and ``load_image_model`` rebuilds
    the fake-quantised model with the learned ranges: its held-out top-1 is the run's ``eval/top1``."""
    from crosstrain.plugins.compress.qat.conv import FakeQuantConv2d, FakeQuantStaticLinear
    from crosstrain.plugins.vision.data.sources import digits
    from crosstrain.plugins.vision.load import load_image_model

    last = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["eval/top1"] > 0.8 and np.isfinite(last["eval/fp/loss"])
    model = load_image_model(run)
    kinds = [type(m) for m in model.model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert kinds == [FakeQuantConv2d] * 4 + [FakeQuantStaticLinear]
    _, held = digits()
    with torch.no_grad():
        pred = model.model(model.preprocess([held.load(i) for i in range(len(held))])).argmax(-1).numpy()
    assert float((pred == np.asarray(held.labels)).mean()) == pytest.approx(last["eval/top1"], abs=1e-6)


def test_export_quantize_writes_the_trained_integers_within_the_bound(run, tmp_path, capsys) -> None:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    from crosstrain.plugins.vision.data.sources import digits
    from crosstrain.plugins.vision.load import load_image_model

    out = tmp_path / "digits.int8.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), "--quantize", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.int8.onnx"]  # no temp left
    # 9 quantised activations (the images, each conv input and output, the head's input) + 5 weights
    assert report["stored_checked"] == 14 and report["parity"]["passed"] and report["parity"]["batches"] == 5
    assert report["parity"]["worst_ratio"] <= 1 and report["parity"]["held_out_top1_agree"] >= 87 / 88
    graph = onnx.load(str(out))
    assert {p.key: p.value for p in graph.metadata_props}["crosstrain.quantization"] == "int8-qat-qdq"
    assert len([t for t in graph.graph.initializer if t.data_type == TensorProto.INT8]) >= 5
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    opts.log_severity_level = 4
    session = ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ops.count("QLinearConv") == 4 and ops.count("QGemm") == 1  # onnxruntime computes in integers
    # every held-out digit: onnxruntime's top-1 against the fake-quantised model's, and the reported figure
    model = load_image_model(run)
    _, held = digits()
    x = model.preprocess([held.load(i) for i in range(len(held))])
    with torch.no_grad():
        ref = model.model(x).numpy()
    got = session.run(None, {"images": x.numpy()})[0]
    assert float((got.argmax(-1) == ref.argmax(-1)).mean()) >= 367 / 368
    top1 = float((got.argmax(-1) == np.asarray(held.labels)).mean())
    assert report["figures"]["int8_top1"] == pytest.approx(top1, abs=1e-9) and report["figures"]["images"] == 368


def test_gate_catches_a_wrong_scale(run, tmp_path) -> None:
    """A QAT file whose head weight scales are 5% off: the stored check names it, and so does the bound alone."""
    import dataclasses

    import onnx
    from onnx import numpy_helper

    from crosstrain.plugins.export.errors import ParityError
    from crosstrain.plugins.vision.export import trace
    from crosstrain.plugins.vision.load import load_image_model
    from crosstrain.plugins.vision.qat_export import (
        check_qat_parity,
        check_stored,
        export_qat_classifier,
        float_twin,
        overrides,
    )

    model = load_image_model(run)
    good = tmp_path / "good.onnx"
    export_qat_classifier(model, good)
    graph = onnx.load(str(good))
    for t in graph.graph.initializer:
        if t.name == "head.weight_scale":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(1.05), t.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(graph, str(bad))
    assert not check_qat_parity(model, bad).passed
    fp = tmp_path / "float.onnx"
    trace(dataclasses.replace(model, model=float_twin(model.model)), fp, None)
    traced = onnx.load(str(fp))
    given = overrides(model.model, traced)
    weights = {n.name: n.input[1] for n in traced.graph.node if n.input[1:2] and n.input[1] in given}
    assert check_stored(onnx.load(str(good)), given, weights, model.model) == 14
    with pytest.raises(ParityError, match="head.weight is not the fake quantiser's") as err:
        check_stored(graph, given, weights, model.model)
    assert "\n" not in str(err.value)


def test_refusals_are_one_line(run, tmp_path, capsys) -> None:
    for sets, words in ((["quant.qat=int8-act-int4-weight"], 'trains with quant.qat="int8"'),
                        (["quant.qat=int8", "classify.ema_decay=0.9"], "classify.ema_decay=0"),
                        (["quant.qat=int8", "classify.model=timm:resnet10t"], "with BatchNorm")):
        bad = tmp_path / "bad"
        capsys.readouterr()
        assert crosstrain_main(_argv(bad, *RUN, "train.steps=1", *sets)) == 2
        assert words in one_line_error(*capsys.readouterr())[-1]
        assert not bad.exists()  # refused before anything was written
    toml = tmp_path.parent / "qat4.toml"  # the same key from a TOML file
    toml.write_text('[train]\nrecipe = "classify"\nsteps = 1\n[quant]\nqat = "int8-act-int4-weight"\n')
    capsys.readouterr()
    assert crosstrain_main(["train", str(toml), "--run-dir", str(tmp_path / "bad"), "--set", "backend=cpu"]) == 2
    assert 'trains with quant.qat="int8"' in one_line_error(*capsys.readouterr())[-1]
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "x.onnx"
    for flags, words in ((["--int8"], "--quantize, not --int8"), (["--ptq", "int8"], "--ptq quantises a GPT's"),
                         (["--quantize", "int8-act-int4-weight"], "int8 only"),
                         (["--quantize", "--group-size", "32"], "drop the flag"),
                         # a fixed bound no integer model meets: the real gate fails after quantising, nothing left
                         (["--quantize", "--quant-tolerance", "1e-9"], "QAT parity check failed")):
        capsys.readouterr()
        assert crosstrain_main(["export", str(run), "--out", str(out), *flags]) != 0
        assert words in one_line_error(*capsys.readouterr())[-1]
        assert not any(tmp_path.iterdir())
