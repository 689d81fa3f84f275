"""A trained ``classify`` run, deployed: ``crosstrain serve`` (a real server process, real HTTP requests) answers every
held-out digit with the top-1 ``crosstrain eval --predictions`` gives, base64 JSON and multipart alike; ``--watch``
swaps in the checkpoint a resumed run writes (its params_sha256); ``crosstrain export`` writes an ONNX classifier
that passes the fp32 parity gate and gives eval's top-1 on every held-out image through onnxruntime; a ``detect``
run serves the boxes its own eval path computes. Refusals are one line and write nothing."""

from __future__ import annotations

import base64
import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from in_process import crosstrain_main
from one_line import one_line_error
from serve_process import serve_process

pytest.importorskip("sklearn")
pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")
httpx = pytest.importorskip("httpx")
try:  # through the plugin's import, which works on the CPU build of torch (crosstrain.plugins.vision.tv)
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("needs the vision extra (torchvision, timm)", allow_module_level=True)

STEPS = 150
RUN = ["logging.progress=none", "backend=cpu", "eval.max_batches=0", f"eval.every={STEPS}", f"checkpoint.every={STEPS}"]


def _train(run: Path, steps: int = STEPS) -> None:
    argv = ["train", "--recipe", "classify", "--run-dir", str(run)]
    for s in (*RUN, f"train.steps={steps}"):
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("classify_serve") / "run"
    _train(out)
    return out


@pytest.fixture(scope="module")
def predictions(run: Path, tmp_path_factory) -> list[dict]:
    """``crosstrain eval RUN --predictions FILE``: one row per held-out image, checked against eval's own top-1."""
    path = tmp_path_factory.mktemp("eval") / "predictions.jsonl"
    assert crosstrain_main(["eval", str(run), "--set", "eval.max_batches=0", "--predictions", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(368))
    top1 = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]["eval/top1"]
    assert sum(r["pred"] == r["label"] for r in rows) / 368 == pytest.approx(top1, abs=1e-6)
    return rows


def _held_out_pngs() -> tuple[list[bytes], np.ndarray]:
    """The 368 held-out digits as PNG files (lossless: the uint8 pixels eval reads), in eval's order."""
    from PIL import Image

    from crosstrain.plugins.vision.data.sources import digits

    _, held = digits()
    files = []
    for i in range(len(held)):
        buf = io.BytesIO()
        Image.fromarray(held.load(i)[0].numpy()).save(buf, format="PNG")
        files.append(buf.getvalue())
    return files, held.labels


def test_serve_gives_eval_top1_on_every_held_out_image(run, predictions, tmp_path) -> None:
    files, labels = _held_out_pngs()
    assert [r["label"] for r in predictions] == labels.tolist()
    with serve_process([str(run)], tmp_path / "serve.log") as server:
        got: list[dict] = []
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for start in range(0, 368, 92):  # base64 JSON
                chunk = [base64.b64encode(f).decode() for f in files[start:start + 92]]
                reply = client.post("/v1/images/classify", json={"images": chunk, "top_k": 3})
                assert reply.status_code == 200, reply.text
                got += [row["top_k"] for row in reply.json()["data"]]
            multipart = client.post("/v1/images/classify", data={"top_k": "2"},
                                    files=[("images", (f"{i}.png", files[i], "image/png")) for i in range(16)])
            assert multipart.status_code == 200, multipart.text
            models = client.get("/v1/models").json()["data"][0]
            wrong = client.post("/v1/images/detect", json={"images": [base64.b64encode(files[0]).decode()]})
            not_b64 = client.post("/v1/images/classify", json={"images": ["not base64!"]})
            not_image = client.post("/v1/images/classify", json={"images": [base64.b64encode(b"text").decode()]})
            big = io.BytesIO()
            from PIL import Image

            Image.new("L", (16, 16)).save(big, format="PNG")
            sixteen = base64.b64encode(big.getvalue()).decode()
            wrong_size = client.post("/v1/images/classify", json={"images": [sixteen]})
            one = base64.b64encode(files[0]).decode()
            other_model = client.post("/v1/images/classify", json={"images": [one], "model": "other"})
            too_many = client.post("/v1/images/classify", json={"images": [one] * 513})
    assert len(got) == 368
    assert [g[0]["label"] for g in got] == [p["pred"] for p in predictions]  # the acceptance point
    assert all(g[0]["class"] == p["class"] for g, p in zip(got, predictions, strict=True))
    np.testing.assert_allclose([g[0]["score"] for g in got], [p["score"] for p in predictions], rtol=1e-5, atol=1e-6)
    assert all(len(g) == 3 and g[0]["score"] >= g[1]["score"] >= g[2]["score"] for g in got)
    assert [r["top_k"] for r in multipart.json()["data"]] == [g[:2] for g in got[:16]]
    summary = json.loads((run / "summary.json").read_text())
    assert models["id"] == "run" and models["step"] == STEPS and models["params_sha256"] == summary["params_sha256"]
    assert models["classes"] == [str(c) for c in range(10)] and models["input"] == {"channels": 1, "size": [8, 8]}
    assert wrong.status_code == 404 and "/v1/images/classify" in wrong.json()["error"]["message"]
    assert not_b64.status_code == 400 and "base64" in not_b64.json()["error"]["message"]
    assert not_image.status_code == 400 and "readable image" in not_image.json()["error"]["message"]
    assert wrong_size.status_code == 400 and "8x8" in wrong_size.json()["error"]["message"]
    assert other_model.status_code == 404 and other_model.json()["error"]["code"] == "model_not_found"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "images"


def test_watch_swaps_in_the_checkpoint_of_a_resumed_run(run, tmp_path) -> None:
    live = tmp_path / "live"
    shutil.copytree(run, live)
    files, _ = _held_out_pngs()
    image = base64.b64encode(files[0]).decode()
    key = "vision-test-key"  # the image endpoints authenticate as the language-model server does
    with serve_process([str(live), "--watch", "--poll-s", "0.3"], tmp_path / "serve.log", api_key=key) as server:
        assert httpx.post(f"{server.url}/v1/images/classify", json={"images": [image]}).status_code == 401
        with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
            assert client.post("/v1/images/classify", json={"images": [image]}).json()["step"] == STEPS
            _train(live, STEPS + 30)  # resumes from step_150 and writes step_180
            deadline = time.monotonic() + 120
            while client.get("/health").json()["step"] != STEPS + 30:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
                time.sleep(0.2)
            health = client.get("/health").json()
            after = client.post("/v1/images/classify", json={"images": [image]}).json()
    summary = json.loads((live / "summary.json").read_text())
    assert health["version"] == 2 and health["params_sha256"] == summary["params_sha256"]
    assert health["events"][-1]["event"] == "swapped" and health["gate"]["passed"]
    assert after["version"] == 2 and after["step"] == STEPS + 30


def test_export_onnx_passes_the_gate_and_gives_eval_top1(run, predictions, tmp_path, capsys) -> None:
    import onnx

    from crosstrain.plugins.export.runtime import make_session
    from crosstrain.plugins.vision.load import load_image_model

    out = tmp_path / "digits.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["parity"]["passed"] and report["parity"]["max_abs_err"] <= 1e-4 == report["parity"]["tolerance"]
    assert report["parity"]["top1_agree"] and report["parity"]["batches"] >= 4
    meta = json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}["crosstrain.images"])
    assert meta["classes"] == [str(c) for c in range(10)] and meta["size"] == [8, 8] and meta["step"] == STEPS
    # every held-out image through onnxruntime, preprocessed as the metadata says: eval's top-1
    from crosstrain.plugins.vision.data.sources import digits

    _, held = digits()
    x = (held.images.numpy().astype(np.float32) / 255 - np.float32(meta["mean"][0])) / np.float32(meta["std"][0])
    logits = make_session(out).run(None, {"images": x})[0]
    assert logits.argmax(-1).tolist() == [p["pred"] for p in predictions]
    model = load_image_model(run)
    assert model.params_sha256 == json.loads((run / "summary.json").read_text())["params_sha256"]


def test_export_int8_is_quantized_smaller_and_gated_on_held_out_top1(run, predictions, tmp_path, capsys) -> None:
    """``--int8``: a QDQ int8 file next to the fp32 one, smaller, whose gate figures are what onnxruntime gives on
    all 368 held-out digits (recomputed here from the files the export wrote)."""
    import onnx
    from onnx import TensorProto

    from crosstrain.plugins.export.runtime import make_session
    from crosstrain.plugins.vision.data.sources import digits

    out = tmp_path / "digits.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), "--int8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    q = tmp_path / "digits.int8.onnx"
    assert report["int8_path"] == str(q) and sorted(report["files"]) == sorted([str(out), str(q)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.int8.onnx", "digits.onnx"]  # no temp left
    graph = onnx.load(str(q))
    ops = {n.op_type for n in graph.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    int8_weights = [t for t in graph.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) == 4]
    assert len(int8_weights) == 4  # the digits CNN's four conv kernels are stored as int8
    meta = {p.key: p.value for p in graph.metadata_props}
    fp32_meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["crosstrain.images"] == fp32_meta["crosstrain.images"]
    assert meta["crosstrain.quantization"] == "int8-static-qdq"
    gate = report["int8"]
    assert q.stat().st_size == gate["int8_bytes"] < out.stat().st_size == gate["fp32_bytes"]
    # the gate's figures, recomputed on every held-out image from the two published files
    _, held = digits()
    m = json.loads(fp32_meta["crosstrain.images"])
    x = (held.images.numpy().astype(np.float32) / 255 - np.float32(m["mean"][0])) / np.float32(m["std"][0])
    p32 = make_session(out).run(None, {"images": x})[0].argmax(-1)
    p8 = make_session(q).run(None, {"images": x})[0].argmax(-1)
    assert p32.tolist() == [p["pred"] for p in predictions]
    assert gate["images"] == 368 and gate["top1_agreement"] == pytest.approx(float((p32 == p8).mean()), abs=1e-9)
    assert gate["fp32_top1"] == pytest.approx(float((p32 == held.labels).mean()), abs=1e-9)
    assert gate["int8_top1"] == pytest.approx(float((p8 == held.labels).mean()), abs=1e-9)
    assert gate["passed"] and gate["top1_agreement"] >= 0.99 and gate["drop_points"] <= 0.5
    assert gate["fp32_latency_us"] > 0 and gate["int8_latency_us"] > 0  # benchmark figures, not asserted on


def test_export_int8_failing_gate_writes_nothing(run, tmp_path) -> None:
    """An agreement bound no model can meet (101%): the real gate fails, one line, nothing at either path."""
    from crosstrain.plugins.export.errors import ParityError
    from crosstrain.plugins.vision.export import export_classifier
    from crosstrain.plugins.vision.load import load_image_model

    out = tmp_path / "digits.onnx"
    with pytest.raises(ParityError, match="int8 gate failed: top-1 agreement") as err:
        export_classifier(load_image_model(run), out, tolerance=1e-4, int8=True, min_agreement=1.01)
    assert "\n" not in str(err.value) and "nothing was written" in str(err.value)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("flags", "words"), [
    (["--int8", "--int8-tolerance", "0.5"], "--int8-tolerance bounds a GPT's int8 logit error"),
    (["--quantize", "int8"], "was not trained with QAT"),
    (["--ptq", "int8"], "--ptq quantises a GPT's"),
    (["--format", "safetensors"], "--format onnx"),
])
def test_export_refusals_are_one_line_and_write_nothing(run, tmp_path, capsys, flags, words) -> None:
    out = tmp_path / "x.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), *flags]) != 0
    captured = capsys.readouterr()
    assert words in one_line_error(captured.out, captured.err)[-1]
    assert not out.exists() and not any(tmp_path.iterdir())


def test_eval_predictions_refusals(run, tmp_path, capsys) -> None:
    missing_folder = str(tmp_path / "no" / "p.jsonl")
    for flags in (["--predictions", missing_folder], ["--predictions", str(tmp_path), "--nproc", "1"]):
        capsys.readouterr()
        assert crosstrain_main(["eval", str(run), *flags]) == 2
        captured = capsys.readouterr()
        assert "--predictions" in one_line_error(captured.out, captured.err)[-1]
    assert not any(tmp_path.iterdir())


def test_serve_detect_run_gives_the_eval_path_boxes(tmp_path) -> None:
    """A 1-step detect run (score_thresh 0, so the untrained detector reports boxes): POST /v1/images/detect on the
    held-out PNGs equals the recipe's held-out path (DetectDataset at eval_size, boxes scaled back) in process."""
    pytest.importorskip("pycocotools")
    import torch

    from crosstrain.plugins.vision.detect.data import CocoSamples, DetectDataset
    from crosstrain.plugins.vision.load import load_image_model

    shapes, det = tmp_path / "shapes", tmp_path / "detect"
    sets = ["detect.shapes_train=4", "detect.shapes_val=4", "detect.shapes_size=32", "detect.min_size=32",
            "detect.max_size=32", "detect.eval_size=32", "detect.fpn_channels=64", "detect.score_thresh=0.0",
            "detect.detections_per_img=5", "train.batch_size=4", "eval.batch_size=4", "train.steps=1",
            "eval.every=0", "checkpoint.every=0", "checkpoint.final=true", "logging.progress=none", "backend=cpu",
            f"detect.shapes_dir={shapes}"]
    argv = ["train", "--recipe", "detect", "--run-dir", str(det)]
    for s in sets:
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    model = load_image_model(det)
    root = next(p for p in shapes.iterdir() if p.is_dir())
    val = CocoSamples(root / "val", root / "val.json")
    data = DetectDataset(val, sizes=[32], seed=0)
    batch = data.batch(np.arange(len(val)))
    with torch.no_grad():
        expected = model.model.eval()(batch.images)
    files = [(root / "val" / val.coco.loadImgs(i)[0]["file_name"]).read_bytes() for i in val.ids]
    with serve_process([str(det)], tmp_path / "serve.log") as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            reply = client.post("/v1/images/detect", json={"images": [base64.b64encode(f).decode() for f in files]})
            wrong = client.post("/v1/images/classify", json={"images": [base64.b64encode(files[0]).decode()]})
    assert reply.status_code == 200, reply.text
    got = reply.json()["data"]
    assert wrong.status_code == 404
    for row, exp, scale in zip(got, expected, batch.scales.tolist(), strict=True):
        dets = row["detections"]
        assert len(dets) == len(exp["boxes"]) == 5
        np.testing.assert_allclose([d["box"] for d in dets], exp["boxes"].double().numpy() * scale, atol=2e-3)
        assert [d["label"] for d in dets] == exp["labels"].tolist()
        np.testing.assert_allclose([d["score"] for d in dets], exp["scores"].numpy(), rtol=1e-5)
        assert all(d["class"] == model.classes[d["label"]] for d in dets)


def test_serve_refuses_the_onnxruntime_engine_on_an_image_run(run, capsys) -> None:
    capsys.readouterr()
    assert crosstrain_main(["serve", str(run), "--engine", "onnxruntime", "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert "--engine torch" in one_line_error(captured.out, captured.err)[-1]
