"""``crosstrain export <detect run>``: a tiny FCOS and RetinaNet run (2 steps on the embedded shapes) export to ONNX
with torchvision's post-processing in the graph (NonMaxSuppression); onnxruntime gives PyTorch's detections on
the held-out PNG files, square and cropped to non-square, within the gate's stated bounds; the gate fails on a
tampered graph and with --tolerance 0; refusals are one line and write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from in_process import crosstrain_main
from one_line import one_line_error

pytest.importorskip("pycocotools")
pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
try:  # through the plugin's import, which works on the CPU build of torch (crosstrain.plugins.vision.tv)
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("needs the vision extra (torchvision)", allow_module_level=True)

import torch  # noqa: E402

# score_thresh 0: the few-step detectors then report detections_per_img boxes an image (an untrained RetinaNet's
# scores sit near its 0.01 prior, under the default 0.05; 4 steps at lr 1e-2 spread its top 20 over 0.010-0.014,
# where 2 steps at 1e-3 leave them within 1e-5, closer than the score bound, so every one would be a tie);
# fpn_channels 64: FCOS's GroupNorm(32, C) needs C > 32 for one 32 px image (its 1x1 P7 level)
SETS = ["detect.shapes_train=4", "detect.shapes_val=6", "detect.shapes_size=32", "detect.min_size=32",
        "detect.max_size=32", "detect.eval_size=32", "detect.fpn_channels=64", "detect.score_thresh=0.0",
        "detect.detections_per_img=20", "train.batch_size=4", "eval.batch_size=4", "eval.every=0",
        "checkpoint.every=0", "checkpoint.final=true", "logging.progress=none", "backend=cpu"]
STEPS = {"fcos_resnet18_fpn": ["train.steps=2"],
         "retinanet_resnet18_fpn": ["train.steps=4", "optim.lr=1e-2", "schedule.warmup_steps=0"]}


_RUNS: dict[str, Path] = {}
_EXPORTS: dict[str, tuple[Path, dict]] = {}


def _train(model: str, factory) -> Path:
    if model not in _RUNS:
        base = factory.mktemp(model)
        argv = ["train", "--recipe", "detect", "--run-dir", str(base / "run"), "--set", f"detect.model={model}",
                "--set", f"detect.shapes_dir={factory.getbasetemp() / 'shapes'}"]
        for s in (*SETS, *STEPS[model]):
            argv += ["--set", s]
        assert crosstrain_main(argv) == 0
        _RUNS[model] = base / "run"
    return _RUNS[model]


def _export(run: Path) -> tuple[Path, dict]:
    """``crosstrain export RUN --json``: the file and its report (once per run)."""
    import contextlib
    import io

    if str(run) not in _EXPORTS:
        out = run.parent / "export" / "detector.onnx"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert crosstrain_main(["export", str(run), "--out", str(out), "--json"]) == 0
        _EXPORTS[str(run)] = out, json.loads(buf.getvalue().strip().splitlines()[-1])
    return _EXPORTS[str(run)]


@pytest.fixture(scope="module", params=["fcos_resnet18_fpn", "retinanet_resnet18_fpn"])
def each_run(request, tmp_path_factory) -> Path:
    return _train(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The FCOS run (the gate's failure paths and the refusals do not depend on the detector)."""
    return _train("fcos_resnet18_fpn", tmp_path_factory)


@pytest.fixture(scope="module")
def exported(run: Path) -> tuple[Path, dict]:
    return _export(run)


def _ops(graph) -> set[str]:
    """Op types of a graph and of its subgraphs (If branches)."""
    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs]:
                ops |= _ops(sub)
    return ops


def _held_out_files(run: Path) -> list[torch.Tensor]:
    """The held-out PNGs decoded as ``crosstrain serve`` decodes them, resized as its detect path resizes them
    (longer side eval_size), then each again cropped to its top 3/4 (a non-square input): float [3, H, W]."""
    from torchvision.transforms import v2

    from crosstrain.plugins.vision.load import decode_image

    folder = next(p for p in (run.parent.parent / "shapes").iterdir() if p.is_dir()) / "val"
    images = []
    for f in sorted(folder.glob("*.png")):
        img = v2.functional.to_dtype(decode_image(f.read_bytes(), 3), torch.float32, scale=True)
        scale = 32 / max(img.shape[-2:])
        img = v2.functional.resize(img, [round(img.shape[-2] * scale), round(img.shape[-1] * scale)])
        images += [img, img[:, : img.shape[1] * 3 // 4]]
    return images


def test_onnxruntime_gives_pytorch_detections_on_held_out_files(each_run) -> None:
    from crosstrain.plugins.export.runtime import make_session
    from crosstrain.plugins.vision.load import load_image_model

    run = each_run
    out, report = _export(run)
    parity = report["parity"]
    assert parity["passed"] and parity["counts_equal"] and parity["all_matched"] and parity["images"] == 21
    assert report["files"] == [str(out)] and sorted(p.name for p in out.parent.iterdir()) == ["detector.onnx"]
    graph = onnx.load(str(out))
    assert "NonMaxSuppression" in _ops(graph.graph)  # torchvision's symbolic, not a hand-written NMS
    assert [i.name for i in graph.graph.input] == ["images"]
    assert [o.name for o in graph.graph.output] == ["boxes", "scores", "labels"]
    model = load_image_model(run)
    meta = json.loads({p.key: p.value for p in graph.metadata_props}["crosstrain.images"])
    assert meta["classes"] == model.classes == ["", "circle", "square", "triangle"]
    assert meta["batch"] == 1 and meta["size"] == [32, 32] and meta["step"] == model.step
    assert meta["params_sha256"] == json.loads((run / "summary.json").read_text())["params_sha256"]
    # every held-out file, and its non-square crop, through both: PyTorch's detections within the gate's bounds
    session = make_session(out)
    box_tol, score_tol = parity["box_tolerance_px"], parity["score_tolerance"]
    # the bound's closed form: 1e-4 x (largest anchor side + the 32 px image side); FCOS's largest anchor is its
    # 128 px stride, RetinaNet's the 203 px (int(128 * 2^(2/3))) anchor at aspect ratio 1/2, 203 * sqrt(2) wide,
    # its half-width rounded as torchvision's AnchorGenerator rounds: 2 * 144
    side = {"FCOS": 128, "RetinaNet": 2 * round(203 * 2 ** 0.5 / 2)}[meta["model"]]
    assert box_tol == pytest.approx(1e-4 * (side + 32), rel=1e-9) and score_tol == 1e-4
    images = _held_out_files(run)
    assert len(images) == 12 and images[1].shape[1:] == (24, 32)
    matched = 0
    for img in images:
        with torch.no_grad():
            ref = model.model([img])[0]
        boxes, scores, labels = session.run(None, {"images": img[None].numpy()})
        assert len(labels) == len(ref["labels"]) == 20
        rs = ref["scores"].numpy()
        for b, s, lab in zip(ref["boxes"].numpy(), rs, ref["labels"].numpy(), strict=True):
            same = labels == lab  # the nearest onnxruntime box of the same label (order may swap at score ties)
            err = np.abs(boxes[same] - b).max(axis=1) if same.any() else np.array([np.inf])
            k = int(err.argmin())
            if err[k] <= box_tol and abs(scores[same][k] - s) <= score_tol:
                matched += 1
            else:  # only a tie at the cut (the 20th score) may be kept by one side alone
                assert s - rs.min() <= score_tol, (s, rs.min())
    assert matched >= 240 - len(images)  # at most one tie at the cut an image


@pytest.mark.parametrize("tensor", ["detector.head.regression_head.bbox_reg.bias",
                                    "detector.head.classification_head.cls_logits.bias"])
def test_gate_fails_on_a_tampered_graph(run, exported, tmp_path, tensor) -> None:
    """0.01 added to one head's bias (boxes: 0.01 x the anchor side, 0.08-1.3 px; scores: ~0.01 x sigmoid'): the
    gate that passed on the exported file fails on the tampered one."""
    from onnx import numpy_helper

    from crosstrain.plugins.vision.export_detect import check_detect_parity
    from crosstrain.plugins.vision.load import load_image_model

    graph = onnx.load(str(exported[0]))
    init = next(t for t in graph.graph.initializer if t.name == tensor)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.float32(0.01), tensor))
    onnx.save(graph, str(tmp_path / "tampered.onnx"))
    model = load_image_model(run)
    parity = check_detect_parity(model, tmp_path / "tampered.onnx", 1e-4)
    assert not parity.passed and "no onnxruntime match" in parity.first_mismatch and "FAILED" in parity.describe()


def test_tolerance_zero_fails_in_one_line_and_writes_nothing(run, exported, tmp_path, capsys) -> None:
    """The exported graph's boxes differ from PyTorch's (by less than the bound: the first test), so a tolerance
    of 0 fails the real gate: one line, the parity exit code, no file and no temp folder."""
    assert exported[1]["parity"]["max_box_err_px"] > 0
    out = tmp_path / "d.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), "--tolerance", "0"]) == 7
    captured = capsys.readouterr()
    assert "ONNX detector parity check failed" in one_line_error(captured.out, captured.err)[-1]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("flags", "words"), [
    (["--int8"], "--int8 is not built for a --recipe detect run"),
    (["--opset", "10"], "--opset >= 11"),
    (["--format", "safetensors"], "a detector exports with --format onnx"),
    (["--quantize", "int8"], "a --recipe detect run has no integer export"),
])
def test_refusals_are_one_line_and_write_nothing(run, tmp_path, capsys, flags, words) -> None:
    out = tmp_path / "d.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--out", str(out), *flags]) == 6
    captured = capsys.readouterr()
    assert words in one_line_error(captured.out, captured.err)[-1]
    assert not any(tmp_path.iterdir())
