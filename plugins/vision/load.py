"""A trained image model outside the training loop, for ``crosstrain export`` and ``crosstrain serve``: the run's
own config rebuilds the recipe's model (``classify``: the classifier; ``detect``: the detector), the checkpoint's
consolidated weights are loaded into it (any saved layout; nothing is unpickled), and the held-out preprocessing
of the run (:func:`preprocess`) turns decoded images into what the model was evaluated on."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from crosstrain.checkpoint.resolve import CHECKPOINT, Resolved, resolve_path
from crosstrain.errors import ConfigError

#: the recipes whose runs this module loads
IMAGE_RECIPES = ("classify", "detect")


def run_recipe(source: str | Path) -> str | None:
    """The ``train.recipe`` of the run ``source`` belongs to (a run dir or one of its checkpoints), when it is an
    image recipe; None for anything else (a language model, a file, a path that does not exist)."""
    p = Path(source)
    for run_dir in (p, p.parent, p.parent.parent):
        if (run_dir / "config.toml").is_file() and (run_dir / "checkpoints").is_dir():
            import tomllib

            try:
                recipe = tomllib.loads((run_dir / "config.toml").read_text()).get("train", {}).get("recipe")
            except (OSError, tomllib.TOMLDecodeError):
                return None
            return recipe if recipe in IMAGE_RECIPES else None
    return None


@dataclass
class ImageModel:
    """An image model in eval mode (fp32, CPU) with what serving and export need to know about it."""

    recipe: str
    model: nn.Module
    classes: list[str]  # classify: class names by label; detect: category names by id ("" where unused)
    channels: int
    image_size: int  # classify: 0 = the images' own size (then ``shape`` is it)
    mean: list[float]
    std: list[float]
    shape: tuple[int, int, int]  # classify: [C, H, W] of a held-out image after preprocessing
    source: str
    run_dir: Path | None
    step: int | None
    params_sha256: str
    config: Any = field(repr=False, default=None)

    def preprocess(self, images: list[torch.Tensor]) -> torch.Tensor:
        """uint8 ``[C, H, W]`` images -> the float batch the classifier was evaluated on (the run's held-out
        transform, then its normalisation; :class:`~crosstrain.plugins.vision.data.dataset.SampleMaker`)."""
        from crosstrain.plugins.vision.data.augment import eval_transform, normalize

        transform = eval_transform(self.image_size)
        out = []
        for img in images:
            img = transform(img) if self.image_size else img
            if tuple(img.shape) != self.shape:
                raise ValueError(f"this model takes {self.shape[0]}-channel {self.shape[1]}x{self.shape[2]} images "
                                 f"(the run's vision.image_size={self.image_size}), got "
                                 f"{img.shape[0]}x{img.shape[1]}x{img.shape[2]}; resize it to that size")
            out.append(img)
        return normalize(torch.stack(out), self.mean, self.std)


def decode_image(data: bytes, channels: int) -> torch.Tensor:
    """Encoded image bytes (any format Pillow reads) -> uint8 ``[C, H, W]`` with ``channels`` channels, as
    :class:`~crosstrain.plugins.vision.data.sources.FileSource` decodes a training file; ValueError if unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            pixels = np.asarray(img.convert("L" if channels == 1 else "RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"not a readable image ({type(exc).__name__}); send PNG, JPEG, BMP, GIF or WebP bytes") \
            from None
    return torch.from_numpy(pixels.copy()).reshape(*pixels.shape[:2], -1).permute(2, 0, 1).contiguous()


def load_image_model(source: str | Path | Resolved, *, best: bool = False) -> ImageModel:
    """The model of an image run's checkpoint (a run dir: its newest verified checkpoint, or with ``best`` its best)."""
    from crosstrain.checkpoint.consolidate import load_consolidated
    from crosstrain.config import load_config
    from crosstrain.engine.recipe import resolve_recipe
    from crosstrain.engine.state import params_sha256

    resolved = resolve_path(source, accept=CHECKPOINT, best=best)
    if resolved.run_dir is None or not (resolved.run_dir / "config.toml").is_file():
        raise ConfigError(f"{resolved.path} lies outside an image run's dir, so its recipe config is unknown; pass "
                          "the run dir or its checkpoints/step_N folder")
    config = load_config(resolved.run_dir / "config.toml", [])
    name = config.train.recipe
    if name not in IMAGE_RECIPES:
        raise ConfigError(f"{resolved.run_dir} is a --recipe {name} run, not an image run ({', '.join(IMAGE_RECIPES)})")
    state = load_consolidated(resolved, check=not resolved.verified)
    sha = params_sha256(state)
    recipe = resolve_recipe(name)
    recipe.validate(config)
    rng = torch.random.get_rng_state()  # building initialises weights from the global RNG; they are replaced
    try:
        model, classes, shape = (_classifier(recipe, config) if name == "classify" else _detector(recipe, config))
    finally:
        torch.random.set_rng_state(rng)
    if name == "classify":  # the plugins' model transforms as training applied them (QAT's fake quantisers)
        from crosstrain.engine.models import transform_model

        model = transform_model(model, "model", config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        detail = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise ConfigError(f"{resolved.path} does not hold this run's {name} model ({detail}); was config.toml "
                          "edited after training?")
    vision = config.section("vision")
    channels = shape[0]
    return ImageModel(name, model.float().eval(), classes, channels, int(vision.image_size), list(vision.mean),
                      list(vision.std), shape, str(resolved.path), resolved.run_dir, resolved.step, sha, config)


def _classifier(recipe: Any, config: Any) -> tuple[nn.Module, list[str], tuple[int, int, int]]:
    from crosstrain.config import resolve_import_path
    from crosstrain.plugins.vision.classify.models import build_classifier

    if config.model.import_path:
        model = resolve_import_path(config.model.import_path)(config.model)
    else:
        model = build_classifier(recipe.sec.model, recipe.num_classes, recipe.in_chans, pretrained=False)
    classes = list(recipe.train_source.classes) + [str(c) for c in range(len(recipe.train_source.classes),
                                                                          recipe.num_classes)]
    vision = config.section("vision")
    first = recipe.held_out.load(0) if len(recipe.held_out) else recipe.train_source.load(0)
    side = int(vision.image_size)
    shape = (int(first.shape[0]), side or int(first.shape[1]), side or int(first.shape[2]))
    return model, classes, shape


def _detector(recipe: Any, config: Any) -> tuple[nn.Module, list[str], tuple[int, int, int]]:
    from crosstrain.plugins.vision.detect.models import build_detector

    recipe._load(config)
    sec = recipe.sec
    model = build_detector(sec.model, recipe.num_classes(), channels=sec.fpn_channels,
                           score_thresh=sec.score_thresh, detections_per_img=sec.detections_per_img)
    coco = recipe.train_samples.coco
    names = [""] * recipe.num_classes()
    for cat in coco.loadCats(coco.getCatIds()):
        names[int(cat["id"])] = str(cat["name"])
    return model, names, (3, int(sec.eval_size), int(sec.eval_size))
