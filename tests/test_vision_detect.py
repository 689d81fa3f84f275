"""``--recipe detect`` on tiny embedded shapes: the loss of each step equal to the plain torchvision-style loop's
(rel 1e-5) and on 2 data-parallel processes (FCOS, rel 1e-5), COCO mAP through pycocotools on known detections,
the shapes written deterministically in COCO format, the pure-torch NMS against brute force, seeded augmentation,
and the bad inputs (one line, exit 2, nothing written). The full mAP run (>= 0.8 mAP@.5 beside the plain loop)
is benchmarks/vision_detect.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pycocotools")
try:  # through the plugin's import: PyPI's torchvision does not import as it is beside the CPU build of torch
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("torchvision is not installed (pip install \"crosstrain[vision]\")", allow_module_level=True)

import torch  # noqa: E402
from in_process import crosstrain_main  # noqa: E402
from one_line import one_line_error, raises_one_line  # noqa: E402

TINY = ["detect.shapes_train=12", "detect.shapes_val=8", "detect.shapes_size=32", "detect.min_size=32",
        "detect.max_size=48", "detect.size_step=16", "detect.eval_size=32", "detect.fpn_channels=32",
        "train.batch_size=4", "eval.batch_size=4", "logging.progress=none", "logging.every=1", "backend=cpu",
        "optim.lr=1e-3", "schedule.warmup_steps=2", "checkpoint.every=0", "checkpoint.final=false"]


def _argv(run_dir: Path, shapes: Path, *sets: str) -> list[str]:
    argv = ["train", "--recipe", "detect", "--run-dir", str(run_dir), "--set", f"detect.shapes_dir={shapes}"]
    for s in (*TINY, *sets):
        argv += ["--set", s]
    return argv


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes")


@pytest.mark.parametrize("model", ["fcos_resnet18_fpn", "retinanet_resnet18_fpn"])
def test_each_step_loss_equals_the_plain_torchvision_loop(shapes, tmp_path, model) -> None:
    from crosstrain.config import load_config
    from crosstrain.plugins.vision.data.augment import build_transform
    from crosstrain.plugins.vision.detect import reference
    from crosstrain.plugins.vision.detect.data import DetectDataset
    from crosstrain.plugins.vision.detect.recipe import DetectRecipe

    sets = [f"detect.model={model}", "train.steps=3", "eval.every=3"]
    run = tmp_path / "run"
    assert crosstrain_main(_argv(run, shapes, *sets)) == 0
    rows = _metrics(run)
    ours = [r["loss"] for r in rows if "loss" in r]
    assert len(ours) == 3
    final = rows[-1]
    assert 0.0 <= final["eval/map_50"] <= 1.0 and 0.0 <= final["eval/map"] <= final["eval/map_50"]
    assert {"loss/classification", "loss/bbox_regression"} <= set(rows[0])
    summary = json.loads((run / "summary.json").read_text())["detect"]
    assert summary["eval"] == {"map": final["eval/map"], "map_50": final["eval/map_50"]}  # the run report's figures

    config = load_config(None, ["train.recipe=detect", f"detect.shapes_dir={shapes}", *TINY, *sets])
    recipe = DetectRecipe()
    recipe.validate(config)
    recipe._load(config)
    sec = config.section("detect")
    data = DetectDataset(recipe.train_samples, sizes=sec.train_sizes(), seed=0, augment=build_transform(sec.augment))
    cfg = reference.from_config(config, recipe.num_classes())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the crosstrain run above (one thread, like a launched worker)
    try:
        reference.train(cfg, data)
    finally:
        torch.set_num_threads(threads)
    assert cfg.losses == pytest.approx(ours, rel=1e-5)
    assert len({round(x, 4) for x in ours}) == 3  # it trained: every step's loss differs


def test_shapes_are_deterministic_coco(tmp_path) -> None:
    from crosstrain.plugins.vision.detect.shapes import CATEGORIES, ensure_shapes

    a = ensure_shapes(tmp_path / "a", train=6, val=3, size=40, seed=3)
    b = ensure_shapes(tmp_path / "b", train=6, val=3, size=40, seed=3)
    c = ensure_shapes(tmp_path / "c", train=6, val=3, size=40, seed=4)
    for split in ("train", "val"):
        assert (a / f"{split}.json").read_bytes() == (b / f"{split}.json").read_bytes()
        assert (a / split / "00000.png").read_bytes() == (b / split / "00000.png").read_bytes()
    assert (a / "train.json").read_bytes() != (c / "train.json").read_bytes()
    coco = json.loads((a / "train.json").read_text())
    assert [c["name"] for c in coco["categories"]] == list(CATEGORIES)
    assert {im["id"] for im in coco["images"]} == {an["image_id"] for an in coco["annotations"]}
    for an in coco["annotations"]:
        x, y, w, h = an["bbox"]
        assert 0 <= x and 0 <= y and x + w <= 40 and y + h <= 40 and w >= 1 and h >= 1
    from crosstrain.plugins.vision.detect.data import CocoSamples  # torchvision's CocoDetection reads it

    image, target = CocoSamples(a / "train", a / "train.json")[0]
    assert image.size == (40, 40) and len(target["boxes"]) == sum(an["image_id"] == 1 for an in coco["annotations"])


def test_coco_map_of_known_detections(tmp_path) -> None:
    from pycocotools.coco import COCO

    from crosstrain.plugins.vision.detect.metrics import coco_map
    from crosstrain.plugins.vision.detect.shapes import ensure_shapes

    root = ensure_shapes(tmp_path, train=1, val=4, size=40, seed=0)
    gt = COCO(str(root / "val.json"))
    anns = gt.loadAnns(gt.getAnnIds())
    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
               for a in anns]
    assert coco_map(gt, perfect, range(1, 5)) == {"map": 1.0, "map_50": 1.0}
    wrong_class = [dict(r, category_id=r["category_id"] % 3 + 1) for r in perfect]
    assert coco_map(gt, wrong_class, range(1, 5)) == {"map": 0.0, "map_50": 0.0}
    # each box shifted right by 40% of its width: IoU 0.6/1.4 = 0.43 < 0.5, so nothing matches at any threshold
    shifted = [dict(r, bbox=[r["bbox"][0] + 0.4 * r["bbox"][2], *r["bbox"][1:]]) for r in perfect]
    assert coco_map(gt, shifted, range(1, 5)) == {"map": 0.0, "map_50": 0.0}
    # shifted by 10%: IoU 0.9/1.1 = 0.82, a match at thresholds 0.50..0.80 (7 of 10)
    near = [dict(r, bbox=[r["bbox"][0] + 0.1 * r["bbox"][2], *r["bbox"][1:]]) for r in perfect]
    assert coco_map(gt, near, range(1, 5)) == pytest.approx({"map": 0.7, "map_50": 1.0}, abs=1e-9)


def test_nms_equals_brute_force_greedy() -> None:
    from crosstrain.torchvision_compat import nms

    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=gen) * 30
    boxes = torch.cat([xy, xy + 4 + torch.rand(60, 2, generator=gen) * 10], dim=1)
    scores = torch.rand(60, generator=gen)

    def iou(a: torch.Tensor, b: torch.Tensor) -> float:
        w = max(0.0, float(min(a[2], b[2]) - max(a[0], b[0])))
        h = max(0.0, float(min(a[3], b[3]) - max(a[1], b[1])))
        inter = w * h
        return inter / (float((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])) - inter)

    for threshold in (0.3, 0.5, 0.7):
        keep: list[int] = []
        for i in scores.argsort(descending=True).tolist():
            if all(iou(boxes[i], boxes[k]) <= threshold for k in keep):
                keep.append(i)
        assert nms(boxes, scores, threshold).tolist() == keep


def test_augmentation_is_seeded_per_step_and_sample(tmp_path) -> None:
    from crosstrain.plugins.vision.data.augment import build_transform
    from crosstrain.plugins.vision.detect.data import CocoSamples, DetectDataset
    from crosstrain.plugins.vision.detect.shapes import ensure_shapes

    root = ensure_shapes(tmp_path, train=8, val=1, size=40, seed=0)
    samples = CocoSamples(root / "train", root / "train.json")
    sizes = [32, 40, 48, 56]
    ds = DetectDataset(samples, sizes=sizes, seed=0, augment=build_transform([{"name": "RandomHorizontalFlip"}]))
    plain = DetectDataset(samples, sizes=sizes, seed=0)
    flipped = set()
    for step in range(1, 13):
        ds.step = plain.step = lambda step=step: step
        torch.manual_seed(123)
        expected = torch.rand(1)
        torch.manual_seed(123)
        b = ds.batch([0, 1, 2, 3])
        assert torch.equal(torch.rand(1), expected)  # the global RNG is neither used nor consumed
        again = DetectDataset(samples, sizes=sizes, seed=0, augment=build_transform([{"name": "RandomHorizontalFlip"}]),
                              step=lambda step=step: step).batch([0, 1, 2, 3])
        assert all(torch.equal(x, y) for x, y in zip(b.images, again.images, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(b.boxes, again.boxes, strict=True))
        assert len({im.shape for im in b.images}) == 1 and b.images[0].shape[-1] in sizes  # one size per step
        unaugmented = plain.batch([0])
        flipped.add(not torch.equal(b.images[0], unaugmented.images[0]))
        if flipped:
            size = b.images[0].shape[-1]
            x0 = b.boxes[0][:, 0].sort().values
            ref = unaugmented.boxes[0]
            assert torch.allclose(x0, ref[:, 0].sort().values) or torch.allclose(x0, (size - ref[:, 2]).sort().values)
    assert flipped == {True, False}  # p = 0.5 over 12 steps: image 0 both flipped and not
    assert len({ds.size_at(s) for s in range(1, 13)}) > 1  # multi-scale: the size changes between steps


def _bad(tmp_path: Path, shapes: Path, capsys, *sets: str) -> str:
    run = tmp_path / "bad"
    capsys.readouterr()
    code = crosstrain_main(_argv(run, shapes, "train.steps=1", *sets))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert not run.exists()  # refused before anything was written
    return one_line_error(out, err)[-1]


def test_bad_inputs_are_one_line_and_write_nothing(shapes, tmp_path, capsys) -> None:
    assert "not a torchvision.transforms.v2 transform" in _bad(tmp_path, shapes, capsys,
                                                               'detect.augment=[{name = "RandomFlipp"}]')
    assert "fix the table's arguments" in _bad(tmp_path, shapes, capsys,
                                                'detect.augment=[{name = "RandomHorizontalFlip", q = 1}]')
    assert "does not exist" in _bad(tmp_path, shapes, capsys, f"detect.train_annotations={tmp_path / 'no.json'}",
                                    f"detect.train_images={tmp_path}", f"detect.val_annotations={tmp_path / 'no.json'}",
                                    f"detect.val_images={tmp_path}")
    assert "detect.min_size" in _bad(tmp_path, shapes, capsys, "detect.min_size=64", "detect.max_size=32")
    assert "detect.model" in _bad(tmp_path, shapes, capsys, "detect.model=yolo")
    assert "not built for --recipe detect" in _bad(tmp_path, shapes, capsys, "quant.qat=int8")
    from crosstrain.config import load_config
    from crosstrain.plugins.vision.detect.recipe import DetectRecipe

    for layout in ("parallel.tp=2", "parallel.pp=2"):  # refused by the recipe before the launcher starts a rank
        config = load_config(None, ["train.recipe=detect", layout])
        raises_one_line(lambda config=config: DetectRecipe().validate(config), "parallel.tp=1 and parallel.pp=1")


def test_killed_run_resumes_to_the_same_weights(shapes, tmp_path) -> None:
    """SIGKILL after the step-2 checkpoint, then the same command: the sampler position, the step (augmentation and
    size seeds) and the optimizer come back, so the weights equal the uninterrupted run's."""
    import os
    import sys

    from run_kill import sigkill_after_checkpoint

    sets = ["train.steps=5", "checkpoint.every=2", "eval.every=0", "checkpoint.final=true"]
    ref = tmp_path / "ref"
    assert crosstrain_main(_argv(ref, shapes, *sets)) == 0
    run = tmp_path / "killed"
    argv = _argv(run, shapes, *sets)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sigkill_after_checkpoint([sys.executable, "-m", "crosstrain", *argv], run, 2, env, timeout_s=600)
    assert crosstrain_main(argv) == 0
    ours, theirs = (json.loads((d / "summary.json").read_text()) for d in (run, ref))
    assert ours["steps"] == 5 and ours["steps_this_run"] < 5
    assert ours["params_sha256"] == theirs["params_sha256"]


def test_two_ranks_equal_one_for_fcos(shapes, tmp_path) -> None:
    """FCOS normalises by the foreground count of the global batch (models.GlobalCountFCOSHead), so 2 data-parallel
    processes log the one-process losses (torchvision's per-process count differed by 1e-3 on the first step)."""
    import os
    import subprocess
    import sys

    sets = ["detect.model=fcos_resnet18_fpn", "train.steps=3", "eval.every=0", "train.threads=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert crosstrain_main(_argv(one, shapes, *sets)) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "crosstrain", *_argv(two, shapes, *sets, "parallel.dp_shard=2"),
                           "--nproc", "2"], capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"),
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (json.loads((r / "summary.json").read_text()) for r in (one, two))
    assert b["mesh"]["dp_shard"] == 2 and len(a["losses"]) == len(b["losses"]) == 3
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    assert len({round(x, 4) for x in a["losses"]}) == 3  # it trained
