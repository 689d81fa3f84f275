"""Model transforms change only the models a recipe lets them change (issue 26): a distillation recipe's frozen
teacher, loaded from a trained run, keeps that run's weights (SHA-256) under ``moe.experts=4``, while the
trainable student and a frozen copy marked ``ModelSpec(transform=True)`` get the MoE layers; each transform is
told the model's name and whether it is trainable."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from in_process import crosstrain_main
from torch import nn

from crosstrain import hookimpl
from crosstrain.config import load_config
from crosstrain.engine import Trainer
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe
from crosstrain.engine.state import params_sha256
from crosstrain.recipes.lm import build_model, crosstrain_weights, load_crosstrain_weights

SHAPE = ["model.n_layers=2", "model.dim=32", "model.n_heads=2", "train.seq_len=16", "train.batch_size=2",
         "logging.progress=none", "backend=cpu", "schedule.warmup_steps=0", "eval.every=0"]


class _Tokens:
    """Fixed random token rows; a batch is ``{"tokens": [B, T + 1]}``."""

    def __init__(self) -> None:
        self.rows = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[torch.as_tensor(indices)]}


class _Distill(Recipe):
    """A student learning a frozen teacher's next-token distribution (KL), plus a frozen copy of the student's
    start that transforms may change (as a DPO reference)."""

    name = "test_distill"
    teacher_from = ""

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        student = build_model(context.config)
        teacher = build_model(context.config)
        load_crosstrain_weights(teacher, self.teacher_from)
        import copy

        return {"student": ModelSpec(student),
                "teacher": ModelSpec(teacher, trainable=False, source=self.teacher_from),
                "start": ModelSpec(copy.deepcopy(student), trainable=False, source="initial", transform=True)}

    def build_dataset(self, context: Any) -> _Tokens:
        return _Tokens()

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        inputs = batch["tokens"][:, :-1]
        with torch.no_grad():
            target = F.log_softmax(models["teacher"](inputs).float(), dim=-1)
        logp = F.log_softmax(models["student"](inputs).float(), dim=-1)
        return MicroBatchLoss(F.kl_div(logp, target, log_target=True, reduction="batchmean"))


class _Provides:
    @hookimpl
    def crosstrain_recipe(self, name):
        return _Distill if name == _Distill.name else None

    @hookimpl
    def crosstrain_recipe_names(self):
        return [_Distill.name]


class _Record:
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    @hookimpl
    def crosstrain_transform_model(self, model, name, trainable):
        self.seen.append((name, trainable))


def _moe_blocks(module: nn.Module) -> int:
    from crosstrain.plugins.moe.transform import moe_layers

    return len(moe_layers(module))


def test_frozen_teacher_from_a_run_keeps_its_weights_under_moe(tmp_path: Path, plugin) -> None:
    source = tmp_path / "teacher_run"
    assert crosstrain_main(["train", "--run-dir", str(source), "--set", "train.steps=2", "--set", "checkpoint.every=2",
                            *(a for s in SHAPE for a in ("--set", s))]) == 0
    source_sha = params_sha256(crosstrain_weights(str(source))[0])
    plugin(_Provides(), "distill")
    record = plugin(_Record(), "record")
    _Distill.teacher_from = str(source)
    cfg = load_config(None, [*SHAPE, "train.recipe=test_distill", "train.steps=1", "moe.experts=4",
                             f"train.output_dir={tmp_path / 'runs'}"])
    trainer = Trainer(cfg, run_dir=tmp_path / "distill")
    trainer.setup()
    try:
        models = trainer.models
        assert models["teacher"].sha256 == source_sha  # the checkpoint's frozen record says the same
        assert _moe_blocks(models["teacher"].module) == 0
        assert _moe_blocks(models["student"].module) == 2 == _moe_blocks(models["start"].module)
        student, start = models["student"].module.state_dict(), models["start"].module.state_dict()
        assert all(torch.equal(student[k], start[k]) for k in student)  # the copy got the same experts
        assert record.seen == [("student", True), ("start", False)]  # never the teacher
    finally:
        trainer.teardown()
