"""The vision plugin's pure parts against references: softmax focal loss against its closed form, cross-entropy
with smoothing and weights against torch, class weights and per-class precision/recall against scikit-learn,
per-sample seeded augmentation (the same pixels after a resume, in worker processes, and the caller's RNG
untouched), balanced and square-root sampling frequencies, MixUp/CutMix soft labels, and ImageFolder roots."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn")
try:
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("needs the vision extra (torchvision, timm)", allow_module_level=True)

from crosstrain.plugins.vision.classify.losses import classification_loss, focal_loss, soft_targets  # noqa: E402
from crosstrain.plugins.vision.classify.metrics import batch_metrics, class_report  # noqa: E402
from crosstrain.plugins.vision.data.dataset import ImageDataset, SampleMaker  # noqa: E402
from crosstrain.plugins.vision.data.mix import Mix  # noqa: E402
from crosstrain.plugins.vision.data.sampling import class_weights, sample_weights  # noqa: E402
from crosstrain.plugins.vision.data.sources import digits, image_folder  # noqa: E402

AUG = [{"name": "RandomAffine", "degrees": 15, "translate": [0.1, 0.1]}, {"name": "ColorJitter", "brightness": 0.4},
       {"name": "RandomHorizontalFlip"}]


def test_focal_loss_matches_its_closed_form() -> None:
    # p = softmax([0, log 3]) = (1/4, 3/4): FL(y=1) = -(1 - 3/4)^2 log(3/4), FL(y=0) = -(3/4)^2 log(1/4)
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    fl = focal_loss(logits, soft_targets(torch.tensor([1, 0]), 2), gamma=2.0)
    assert fl.tolist() == pytest.approx([-(0.25**2) * math.log(0.75), -(0.75**2) * math.log(0.25)], rel=1e-6)
    # class weights scale each sample's term by its class's weight; gamma = 0 is cross-entropy
    w = torch.tensor([2.0, 0.5])
    fl_w = focal_loss(logits, soft_targets(torch.tensor([1, 0]), 2), gamma=2.0, weight=w)
    assert fl_w.tolist() == pytest.approx([0.5 * fl[0].item(), 2.0 * fl[1].item()], rel=1e-6)
    x, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 3, 4, 0])
    assert focal_loss(x, soft_targets(y, 5), gamma=0.0).mean().item() == pytest.approx(F.cross_entropy(x, y).item())


def test_cross_entropy_with_smoothing_and_weights_equals_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(4, (8,), generator=gen)
    w = torch.tensor([1.0, 2.0, 0.5, 3.0])
    ours = classification_loss(x, y, label_smoothing=0.1)
    assert ours.item() == pytest.approx(F.cross_entropy(x, y, label_smoothing=0.1).item(), rel=1e-6)
    # weighted: the mean over samples (torch's 'none' reduction, then mean), so split batches average exactly
    weighted = classification_loss(x, y, weight=w)
    assert weighted.item() == pytest.approx(F.cross_entropy(x, y, weight=w, reduction="none").mean().item(), rel=1e-6)
    halves = (classification_loss(x[:4], y[:4], weight=w) + classification_loss(x[4:], y[4:], weight=w)) / 2
    assert halves.item() == pytest.approx(weighted.item(), rel=1e-6)



def test_plain_cross_entropy_takes_torchs_kernel_with_the_general_paths_gradients() -> None:
    """Hard labels, no smoothing or weights: ``F.cross_entropy`` (the fast path) gives the gradients of the general
    soft-label path (focal with gamma 0) bit for bit, and its loss to an ulp, so training is unchanged."""
    gen = torch.Generator().manual_seed(2)
    for batch in (16, 8, 7, 1):
        x = (torch.randn(batch, 10, generator=gen) * 4).requires_grad_()
        y = torch.randint(10, (batch,), generator=gen)
        fast = classification_loss(x, y)
        general = focal_loss(x, soft_targets(y, 10), gamma=0.0).mean()
        assert torch.equal(torch.autograd.grad(fast, x)[0], torch.autograd.grad(general, x)[0])
        assert fast.item() == pytest.approx(general.item(), rel=1e-6)

def test_class_weights_and_per_class_metrics_equal_scikit_learn() -> None:
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support
    from sklearn.utils.class_weight import compute_class_weight

    labels = np.array([0] * 50 + [1] * 5 + [2] * 20)
    ours = class_weights(labels, 3, "inverse")
    assert ours.tolist() == pytest.approx(compute_class_weight("balanced", classes=np.arange(3), y=labels).tolist())
    assert class_weights(labels, 3, "sqrt").tolist() == pytest.approx(np.sqrt(ours.numpy()).tolist())

    gen = torch.Generator().manual_seed(2)
    logits, y = torch.randn(96, 4, generator=gen), torch.randint(4, (96,), generator=gen)
    y[y == 3] = 0  # class 3 never a label: its recall is 0 by definition, its precision 0
    # three equal batches averaged, as the loop does, give the whole set's figures
    parts = [batch_metrics(logits[i:i + 32], y[i:i + 32], top_k=2) for i in (0, 32, 64)]
    avg = {f"eval/{k}": float(sum(p[k] for p in parts) / 3) for k in parts[0]}
    report = class_report(avg)
    pred = logits.argmax(-1).numpy()
    p, r, _, _ = precision_recall_fscore_support(y.numpy(), pred, labels=np.arange(4), zero_division=0)
    for c in range(4):
        assert report[f"eval/precision/{c}"] == pytest.approx(p[c], abs=1e-6)
        assert report[f"eval/recall/{c}"] == pytest.approx(r[c], abs=1e-6)
    cm = confusion_matrix(y.numpy(), pred, labels=np.arange(4))
    for t in range(4):
        for q in range(4):
            assert avg[f"eval/confusion/{t}/{q}"] * 96 == pytest.approx(cm[t, q], abs=1e-4)
    top2 = (logits.topk(2, -1).indices == y[:, None]).any(-1).float().mean().item()
    assert avg["eval/top2"] == pytest.approx(top2, abs=1e-6)


def _dataset(train, **kw) -> ImageDataset:
    maker = SampleMaker(train, kw.pop("augment", AUG), 0, 7, [], [], 10, kw.pop("mix", Mix()))
    return ImageDataset(maker, **kw)


def test_augmentation_is_seeded_per_sample_and_leaves_the_callers_rng_alone() -> None:
    train, _ = digits()
    a, b = _dataset(train), _dataset(train)
    a.set_epoch(3)
    b.set_epoch(3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = a.batch(np.array([5, 9, 11]))
    assert torch.equal(torch.get_rng_state(), before)  # the loop's RNG (checkpointed) did not move
    # another dataset object (a resumed run) and another batch composition give the same pixels per sample
    again = b.batch(np.array([11, 5]))
    assert torch.equal(again["images"][0], first["images"][2]) and torch.equal(again["images"][1], first["images"][0])
    b.set_epoch(4)  # a new epoch: new pixels for the same image
    assert not torch.equal(b.batch(np.array([5]))["images"][0], first["images"][0])
    plain = _dataset(train, augment=[]).batch(np.array([5]))["images"][0]
    assert not torch.equal(plain, first["images"][0])  # the augmentation did something


@pytest.mark.parametrize("augment", [
    [{"name": "RandomAffine", "degrees": 10, "translate": [0.1, 0.1]}],  # the benchmark's
    [{"name": "ColorJitter", "brightness": 0.4}, {"name": "RandomAffine", "degrees": 30, "translate": [0.2, 0.1],
                                                   "scale": [0.8, 1.2], "shear": [-10, 10, -5, 5], "fill": 40}],
    [{"name": "RandomAffine", "degrees": 20, "interpolation": "bilinear", "center": [2.0, 5.5]},
     {"name": "RandomAffine", "degrees": 0, "translate": [0.3, 0.3]}],
])
def test_trailing_affine_steps_on_the_batch_give_the_per_sample_pixels(augment) -> None:
    """An augmentation that ends with ``RandomAffine`` is applied to a batch at once (:mod:`.batched`): the pixels
    equal the v2 transform applied per sample with the same seeds, bit for bit, on 3-channel images too; the
    caller's RNG is left alone and workers give the same."""
    from crosstrain.plugins.vision.data.augment import rng_restored, sample_seed, seeded
    from crosstrain.plugins.vision.data.batched import split_affine_tail

    for channels in (1, 3):
        train, _ = digits(channels)
        maker = SampleMaker(train, augment, 0, 7, [], [], 10)
        assert split_affine_tail(maker.transform) is not None  # the batched path is taken
        items = [(2, k, i) for k, i in enumerate(range(100, 164))]
        torch.manual_seed(5)
        before = torch.get_rng_state()
        with rng_restored():
            batched = torch.stack([x for x, _ in maker.many(items)])
            single = torch.stack([seeded(maker.transform, train.load(i), sample_seed(7, e, k)) for e, k, i in items])
        assert torch.equal(torch.get_rng_state(), before)
        assert batched.dtype == torch.uint8 and torch.equal(batched, single)
        assert not torch.equal(batched, torch.stack([train.load(i) for _, _, i in items]))
    if len(augment) > 1:
        return  # spawning workers takes seconds: checked on the first augmentation only
    pooled = _dataset(train, augment=augment, workers=2)
    try:
        idx = np.arange(40, 52)
        assert torch.equal(_dataset(train, augment=augment).batch(idx)["images"], pooled.batch(idx)["images"])
    finally:
        pooled.close()


def test_worker_processes_give_the_same_pixels() -> None:
    train, _ = digits()
    mix = Mix(mixup_alpha=0.4, cutmix_alpha=1.0, prob=0.8)
    local, pooled = _dataset(train, mix=mix), _dataset(train, mix=mix, workers=2)
    try:
        idx = np.arange(40, 52)
        a, b = local.batch(idx), pooled.batch(idx)
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["targets"], b["targets"])
    finally:
        pooled.close()


def test_mixing_gives_soft_labels_that_sum_to_one() -> None:
    train, _ = digits()
    out = _dataset(train, mix=Mix(mixup_alpha=0.4, cutmix_alpha=1.0, prob=1.0)).batch(np.arange(64))
    t = out["targets"]
    assert t.shape == (64, 10) and torch.allclose(t.sum(-1), torch.ones(64))
    own = t[torch.arange(64), out["labels"]]
    assert (own < 1).float().mean() > 0.75  # mixed (a partner of its own class, or an empty CutMix box, keeps 1)
    unmixed = _dataset(train, mix=Mix(mixup_alpha=0.4, prob=0.0)).batch(np.arange(8))["targets"]
    assert torch.equal(unmixed, F.one_hot(unmixed.argmax(-1), 10).float())


def test_balanced_and_sqrt_sampling_frequencies() -> None:
    train, _ = digits()
    keep = np.flatnonzero((train.labels != 3) | (np.cumsum(train.labels == 3) <= 2))  # class 3: 2 images
    source = train.subset(keep)
    counts = np.bincount(source.labels, minlength=10)
    for kind, expect in (("balanced", np.full(10, 0.1)), ("sqrt", np.sqrt(counts) / np.sqrt(counts).sum())):
        ds = _dataset(source, augment=[], weights=sample_weights(source.labels, 10, kind))
        shown = []
        for epoch in range(30):
            ds.set_epoch(epoch)
            shown.append(source.labels[ds.image_index(np.arange(len(ds)))])
        freq = np.bincount(np.concatenate(shown), minlength=10) / (30 * len(ds))
        assert np.abs(freq - expect).max() < 0.01, (kind, freq)
    ds.set_epoch(0)
    assert np.array_equal(ds.image_index(np.arange(20)), ds.image_index(np.arange(20)))  # a pure function


def test_image_folder_roots(tmp_path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                pixels = rng.integers(0, 255, (6, 5, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    train, val = image_folder(str(tmp_path), 0.2)
    assert train.classes == ["cat", "dog"] and train.labels.tolist() == [0, 0, 0, 1, 1, 1] and len(val) == 6
    img = train.load(4)
    expected = np.asarray(Image.open(tmp_path / "train" / "dog" / "1.png"))
    assert img.shape == (3, 6, 5) and np.array_equal(img.permute(1, 2, 0).numpy(), expected)
    flat = tmp_path / "flat"
    for cls in ("a", "b"):
        (flat / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (4, 4), dtype=np.uint8)).save(flat / cls / f"{i}.png")
    train, val = image_folder(str(flat), 0.2, channels=1)
    assert len(train) == 8 and val.labels.tolist() == [0, 1] and train.load(0).shape == (1, 4, 4)


def test_augment_tables_round_trip_through_the_run_config() -> None:
    from crosstrain.config import load_config
    from crosstrain.config.toml_io import dumps_toml, parse_value

    aug = '[{name = "RandomAffine", degrees = 10, translate = [0.1, 0.1]}, {name = "RandomHorizontalFlip"}]'
    config = load_config(None, ["train.recipe=classify", f"vision.augment={aug}"])
    text = dumps_toml(config.to_dict())
    assert 'augment = [{name = "RandomAffine", degrees = 10, translate = [0.1, 0.1]}' in text
    assert config.section("vision").augment == parse_value(aug)


def test_layer_decay_gives_each_parameter_timms_learning_rate() -> None:
    from timm.optim import param_groups_layer_decay

    from crosstrain.config import load_config
    from crosstrain.engine.run import build_run
    from crosstrain.plugins.vision.classify.models import build_classifier

    cfg = load_config(None, ["train.recipe=classify", "classify.model=timm:resnet18", "classify.layer_decay=0.6",
                             "backend=cpu", "schedule.warmup_steps=0", "schedule.name=constant", "optim.lr=0.01"])
    reference = build_classifier("timm:resnet18", 10, 1)
    expected = {n: g["lr_scale"] * 0.01 for g in param_groups_layer_decay(reference, layer_decay=0.6)
                for n, p in reference.named_parameters() for q in g["params"] if p is q}
    assert len(set(expected.values())) > 5  # stem, four stages, head
    run = build_run(cfg)
    try:
        model = run.models["model"]
        lr_of = {id(p): g["lr"] for g in model.optimizer.param_groups for p in g["params"]}
        got = {n: lr_of[id(p)] for n, p in model.module.named_parameters()}
        assert got.keys() == expected.keys()
        for name, lr in expected.items():
            assert got[name] == pytest.approx(lr, rel=1e-9), name
        assert max(got.values()) == pytest.approx(0.01) and got["fc.weight"] == pytest.approx(0.01)
    finally:
        run.close()
