"""Image classification: crosstrain's ``--recipe classify`` vs a plain PyTorch loop, side by side; and imbalance.

1. **Side by side.** The same 66k-parameter CNN (``DigitsCNN``), the same embedded digits split (1,429 training,
   368 held-out images), the same augmentation (``RandomAffine(10 deg, 10% shift)`` through transforms.v2), batch 16,
   AdamW (lr 3e-3, weight decay 0.1 on matrices), 20 warmup steps then cosine to 0.1x, gradient clipping at 1.0,
   one thread each. The plain loop is what one writes by hand: a ``Dataset`` applying the transform per sample, a
   shuffling ``DataLoader``, ``LambdaLR``. What differs: crosstrain applies the trailing ``RandomAffine`` to each
   batch at once (each image's own seeded parameters, the per-sample pixels bit for bit: docs/vision.md); the plain
   loop calls the v2 transform per sample, as one writes it (``--per-sample-affine`` gives crosstrain the per-sample
   path too, to measure the rest of its step alone). Neither has worker processes. Each runs ``--seeds`` seeds,
   alternating ABBA; a step's time is the wall time between the ends of consecutive steps (everything done per step
   counts), images/s = batch / median step.
   The same intervals are also read on the process's CPU clock (``time.process_time``: every thread of the
   process, nothing of the other jobs on a shared host), whose ratio a loaded machine does not swing.
2. **Imbalance.** A 1000:1 split of the digits, written as an ImageFolder root: one training image of the minority
   class against every training image of the other nine (1,286:1), the standard 368 held-out images. ``--recipe
   classify`` with plain cross-entropy vs the balanced sampler + focal loss (gamma 2), equal steps and seeds: the
   held-out recall of the minority class.

3. **``--channels-last``** (instead of 1 and 2): crosstrain's run with ``vision.channels_last=false`` vs ``true``
   (NCHW vs NHWC weights and batches), ABBA, the same settings; ``--image-size N`` resizes the digits to NxN (3
   channels), a size closer to real images. JSON: images/s per layout on both clocks, ``channels_last_ratio_cpu``.

Last line: JSON with ``accuracy_gap_points`` (|crosstrain - plain| mean held-out top-1, in points),
``images_per_s_ratio`` (crosstrain / plain, wall clock), ``images_per_s_ratio_cpu`` (CPU clock) and
``minority_recall_gain`` (balanced+focal - plain CE).

    python benchmarks/vision.py [--steps 400] [--seeds 3] [--minority 3] [--skip-imbalance] [--per-sample-affine]
    python benchmarks/vision.py --channels-last [--image-size 32] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _timing import alternate, step_clock

AUGMENT = [{"name": "RandomAffine", "degrees": 10, "translate": [0.1, 0.1]}]
SETTINGS = {"batch_size": 16, "lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "min_lr_ratio": 0.1, "grad_clip": 1.0}


def _sets(steps: int, seed: int, *extra: str) -> list[str]:
    aug = "[" + ", ".join("{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in a.items()) + "}" for a in AUGMENT) + "]"
    return ["backend=cpu", f"train.steps={steps}", f"train.seed={seed}", f"train.batch_size={SETTINGS['batch_size']}",
            f"optim.lr={SETTINGS['lr']}", f"optim.weight_decay={SETTINGS['weight_decay']}",
            f"optim.grad_clip={SETTINGS['grad_clip']}", f"schedule.warmup_steps={SETTINGS['warmup']}",
            f"schedule.min_lr_ratio={SETTINGS['min_lr_ratio']}", "train.threads=1", "logging.progress=none",
            "logging.tensorboard=false", f"eval.every={steps}", "eval.max_batches=0", "checkpoint.final=false",
            "checkpoint.every=0", "train.recipe=classify", f"vision.augment={aug}", *extra]


def run_crosstrain(steps: int, seed: int, *extra: str) -> dict[str, Any]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    with tempfile.TemporaryDirectory() as out, step_clock() as clock, step_clock(time.process_time) as cpu:
        Trainer(load_config(None, _sets(steps, seed, *extra)), run_dir=out).fit()
        last = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()][-1]
    return {"top1": last["eval/top1"], "step_s": statistics.median(clock.intervals),
            "cpu_s": statistics.median(cpu.intervals), "metrics": last}


# ------------------------------------------------------------------------------------------------ the plain loop
class _Digits(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: np.ndarray, transform: Any) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.transform(self.images[i]).float() / 255.0
        return (x - 0.5) / 0.5, int(self.labels[i])


def run_plain(steps: int, seed: int) -> dict[str, Any]:
    from crosstrain.plugins.vision.classify.models import DigitsCNN
    from crosstrain.plugins.vision.data.augment import build_transform
    from crosstrain.plugins.vision.data.sources import digits

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    train, held = digits()
    model = DigitsCNN(1, 10)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": SETTINGS["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=SETTINGS["lr"], betas=(0.9, 0.95))
    warm, floor = SETTINGS["warmup"], SETTINGS["min_lr_ratio"]

    def factor(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        progress = min((s - warm) / max(steps - warm, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    loader = torch.utils.data.DataLoader(_Digits(train.images, train.labels, build_transform(AUGMENT)),
                                         batch_size=SETTINGS["batch_size"], shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    ends, cpu, step = [time.perf_counter()], [time.process_time()], 0
    model.train()
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS["grad_clip"])
            opt.step()
            sched.step()
            loss.item()  # a loop logs its loss; crosstrain reads it every step too
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
            step += 1
            if step == steps:
                break
    model.eval()
    with torch.no_grad():
        x = (held.images.float() / 255.0 - 0.5) / 0.5
        top1 = (model(x).argmax(-1).numpy() == held.labels).mean()
    return {"top1": float(top1), "step_s": statistics.median(np.diff(ends).tolist()),
            "cpu_s": statistics.median(np.diff(cpu).tolist())}


# ------------------------------------------------------------------------------------------------- imbalance
def write_imbalanced(root: Path, minority: int) -> dict[str, int]:
    """The digits as an ImageFolder root: train/ keeps one image of ``minority``, val/ the 368 held out."""
    from PIL import Image

    from crosstrain.plugins.vision.data.sources import digits

    train, held = digits()
    first = int(np.flatnonzero(train.labels == minority)[0])
    keep = [i for i in range(len(train)) if train.labels[i] != minority or i == first]
    for split, source, idx in (("train", train, keep), ("val", held, range(len(held)))):
        for i in idx:
            folder = root / split / str(int(source.labels[i]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(source.images[i, 0].numpy()).save(folder / f"{i}.png")
    return {"majority_images": len(keep) - 1, "minority_images": 1}


def imbalance(steps: int, seeds: list[int], minority: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits_1000_to_1"
        counts = write_imbalanced(root, minority)
        data = [f"vision.data={root}", "vision.image_size=8", "vision.channels=1"]
        arms = {"plain_ce": [], "balanced_focal": ["classify.sampling=balanced", "classify.loss=focal"]}
        recall: dict[str, list[float]] = {name: [] for name in arms}
        for seed in seeds:
            for name, extra in arms.items():
                last = run_crosstrain(steps, seed, *data, *extra)["metrics"]
                recall[name].append(last[f"eval/recall/{minority}"])
    means = {k: statistics.fmean(v) for k, v in recall.items()}
    return {"minority_class": minority, **counts, "ratio": counts["majority_images"] / counts["minority_images"],
            "minority_recall": means, "minority_recall_per_seed": recall,
            "minority_recall_gain": means["balanced_focal"] - means["plain_ce"]}


def channels_last(steps: int, seeds: list[int], image_size: int) -> dict[str, Any]:
    """Part 3: the same crosstrain run on NCHW and on NHWC (module docstring)."""
    size = [f"vision.image_size={image_size}", "vision.channels=3"] if image_size else []
    runs = alternate(["nchw", "nhwc"], len(seeds), lambda name, r: run_crosstrain(
        steps, seeds[r], *size, f"vision.channels_last={'true' if name == 'nhwc' else 'false'}"))
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
    return {"settings": {**SETTINGS, "steps": steps, "seeds": seeds, "image_size": image_size or 8, "threads": 1},
            "held_out_top1": {k: [r["top1"] for r in v] for k, v in runs.items()},
            "images_per_s": {k: SETTINGS["batch_size"] / s for k, s in step.items()},
            "images_per_s_cpu": {k: SETTINGS["batch_size"] / s for k, s in cpu.items()},
            "channels_last_ratio": step["nchw"] / step["nhwc"], "channels_last_ratio_cpu": cpu["nchw"] / cpu["nhwc"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--minority", type=int, default=3, help="the digit that is rare (chosen before measuring)")
    p.add_argument("--skip-imbalance", action="store_true")
    p.add_argument("--per-sample-affine", action="store_true",
                   help="crosstrain without its batch RandomAffine kernel (the v2 call per sample, as the plain loop)")
    p.add_argument("--channels-last", action="store_true", help="part 3 only: NCHW vs NHWC (channels_last)")
    p.add_argument("--image-size", type=int, default=0, help="--channels-last: resize the digits to NxN, 3 channels")
    args = p.parse_args()
    if args.channels_last:
        print(json.dumps(channels_last(args.steps, list(range(args.seeds)), args.image_size)))
        return
    if args.per_sample_affine:
        import crosstrain.plugins.vision.data.dataset as dataset

        dataset.split_affine_tail = lambda transform: None  # nothing batched: the v2 call per sample
    seeds = list(range(args.seeds))
    runs = alternate(["crosstrain", "plain"], args.seeds,
                     lambda name, r: (run_crosstrain if name == "crosstrain" else run_plain)(args.steps, seeds[r]))
    top1 = {k: statistics.fmean(r["top1"] for r in v) for k, v in runs.items()}
    step = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_s"] for r in v) for k, v in runs.items()}
    out: dict[str, Any] = {
        "settings": {**SETTINGS, "steps": args.steps, "seeds": seeds, "augment": AUGMENT, "threads": 1,
                     "crosstrain_affine": "per sample" if args.per_sample_affine else "batched"},
        "held_out_top1": top1, "held_out_top1_per_seed": {k: [r["top1"] for r in v] for k, v in runs.items()},
        "images_per_s": {k: SETTINGS["batch_size"] / s for k, s in step.items()},
        "accuracy_gap_points": abs(top1["crosstrain"] - top1["plain"]) * 100,
        "images_per_s_ratio": step["plain"] / step["crosstrain"],
        "images_per_s_cpu": {k: SETTINGS["batch_size"] / s for k, s in cpu.items()},
        "images_per_s_ratio_cpu": cpu["plain"] / cpu["crosstrain"],
        "images_per_s_ratio_per_seed": [p["step_s"] / c["step_s"] for c, p in
                                        zip(runs["crosstrain"], runs["plain"], strict=True)],
    }
    if not args.skip_imbalance:
        out["imbalance"] = imbalance(args.steps, seeds, args.minority)
        out["minority_recall_gain"] = out["imbalance"]["minority_recall_gain"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
