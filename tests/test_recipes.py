"""Recipes and the loop's contracts in-process: recipe selection, auxiliary losses (closed form), hook order,
the typed run context, the gradient hook's contract, the after-optimizer-step hook, and events."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from crosstrain import hookimpl
from crosstrain.cli.main import main
from crosstrain.config import load_config
from crosstrain.engine import Trainer
from crosstrain.engine.aux_loss import add_aux_loss
from crosstrain.engine.context import RunContext
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec, Recipe, resolve_recipe
from crosstrain.errors import ConfigError

SMALL = ["train.steps=4", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu",
         "schedule.warmup_steps=0", "model.n_layers=1", "model.dim=32", "model.n_heads=2"]


def _config(tmp_path, *extra: str):
    return load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'runs'}", *extra])


def test_unknown_recipe_is_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match=r"train.recipe='nope' is not a known recipe; known: lm"):
        resolve_recipe("nope")
    out = tmp_path / "runs"
    assert main(["train", "--recipe", "nope", "--set", f"train.output_dir={out}"]) == 2
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if x]
    assert len(lines) == 1 and "train.recipe='nope' is not a known recipe" in lines[0] and "lm" in lines[0]
    assert not out.exists()


class _Dataset:
    """Fixed random regression samples."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(16, 3, generator=g)
        self.y = torch.randn(16, 2, generator=g)

    def __len__(self) -> int:
        return 16

    def batch(self, indices: Any) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices)
        return {"x": self.x[idx], "y": self.y[idx]}


COEFF = 0.25


class _Regularised(nn.Linear):
    """A linear layer that adds ``COEFF * sum(w^2)`` as an auxiliary loss on every forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        add_aux_loss("l2", COEFF * self.weight.pow(2).sum())
        return super().forward(x)


class _Regression(Recipe):
    name = "test_regression"

    def build_models(self, context: RunContext) -> dict[str, ModelSpec]:
        assert isinstance(context, RunContext) and context.models == {}  # build time: no models yet
        return {"net": ModelSpec(_Regularised(3, 2, bias=False))}

    def build_dataset(self, context: RunContext) -> _Dataset:
        return _Dataset()

    def loss(self, models: Mapping[str, nn.Module], batch: Any) -> MicroBatchLoss:
        err = models["net"](batch["x"]) - batch["y"]
        return MicroBatchLoss(err.pow(2).mean(), {"abs_err": err.abs().mean().detach()})


class _Provides:
    def __init__(self, recipe: type[Recipe]) -> None:
        self.recipe = recipe

    @hookimpl
    def crosstrain_recipe(self, name):
        return self.recipe if name == self.recipe.name else None

    @hookimpl
    def crosstrain_recipe_names(self):
        return [self.recipe.name]


def test_recipe_with_aux_loss_matches_closed_form_sgd(tmp_path, plugin) -> None:
    plugin(_Provides(_Regression), "regression")
    with pytest.raises(ConfigError, match=r"known: lm, .*test_regression"):
        resolve_recipe("other")
    lr = 0.1
    cfg = _config(tmp_path, "train.recipe=test_regression", "train.steps=1", "optim.name=sgd", f"optim.lr={lr}",
                  "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0", "schedule.name=constant",
                  "train.grad_accum=2")
    trainer = Trainer(cfg, run_dir=tmp_path / "r")
    # the same initial weights and batch order as the run, computed by hand
    torch.manual_seed(0)
    w0 = _Regularised(3, 2, bias=False).weight.detach().clone()
    data = _Dataset()
    trainer_summary = trainer.fit()
    from crosstrain.data import DistributedBatchSampler

    sampler = DistributedBatchSampler(16, 4, dp_rank=0, dp_size=1, micro_batches=2, seed=0, shuffle=True)
    grads, losses, abs_errs = [], [], []
    for idx in sampler.next_step():
        w = w0.clone().requires_grad_(True)
        b = data.batch(idx)
        err = b["x"] @ w.T - b["y"]
        mse = err.pow(2).mean()
        (mse + COEFF * w.pow(2).sum()).backward()
        grads.append(w.grad)
        losses.append(float(mse))
        abs_errs.append(float(err.abs().mean()))
    expected = w0 - lr * (grads[0] + grads[1]) / 2
    final = trainer.final_state_dict["weight"]
    torch.testing.assert_close(final, expected, rtol=1e-6, atol=1e-7)
    assert trainer_summary["losses"] == pytest.approx([sum(losses) / 2], rel=1e-6)
    record = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["aux/l2"] == pytest.approx(COEFF * float(w0.pow(2).sum()), rel=1e-6)
    assert record["abs_err"] == pytest.approx(sum(abs_errs) / 2, rel=1e-6)
    assert trainer_summary["recipe"] == "test_regression"


class _Scale:
    def __init__(self, factor: float, log: list) -> None:
        self.factor, self.log = factor, log

    @hookimpl
    def crosstrain_transform_model(self, model, config, name):
        self.log.append((self.factor, name))
        with torch.no_grad():
            model.weight.mul_(self.factor)


class _Shift:
    def __init__(self, log: list) -> None:
        self.log = log

    @hookimpl
    def crosstrain_transform_model(self, model):
        self.log.append("shift")
        with torch.no_grad():
            model.weight.add_(1.0)


def test_model_transforms_run_in_registration_order(tmp_path, plugin) -> None:
    plugin(_Provides(_Regression), "regression")
    torch.manual_seed(0)
    w0 = _Regularised(3, 2, bias=False).weight.detach().clone()
    log: list = []
    plugin(_Scale(3.0, log), "a-scale")
    plugin(_Shift(log), "b-shift")
    cfg = _config(tmp_path, "train.recipe=test_regression", "train.steps=1", "optim.lr=1e-9",
                  "optim.weight_decay=0")
    trainer = Trainer(cfg, run_dir=tmp_path / "r")
    trainer.setup()
    try:
        # scale then shift (3w + 1), not shift then scale (3w + 3): the two do not commute
        torch.testing.assert_close(trainer.model.weight.detach(), w0 * 3.0 + 1.0)
        assert log == [(3.0, "net"), "shift"]
    finally:
        trainer.teardown()


class _Contract:
    """Records what the run-time hooks see."""

    def __init__(self) -> None:
        self.contexts: list[Any] = []
        self.after_steps: list[int] = []
        self.sink_info: Any = None
        self.events: list[tuple[int, str]] = []

    @hookimpl
    def crosstrain_after_optimizer_step(self, context, step):
        self.contexts.append(context)
        self.after_steps.append(step)
        if step == context.config.train.steps:
            with torch.no_grad():  # a round ends: replace the parameters (what federated averaging does)
                for p in context.models["model"].parameters():
                    p.zero_()

    @hookimpl
    def crosstrain_metrics_sinks(self, config):
        hooks = self

        class Sink:
            def open(self, info):
                hooks.sink_info = info

            def write(self, step, metrics):
                pass

            def event(self, step, name, fields):
                hooks.events.append((step, name))

            def close(self):
                pass

        return [Sink()]


def test_after_step_hook_and_sinks_are_wired(tmp_path, plugin) -> None:
    hooks = plugin(_Contract(), "contract")
    cfg = _config(tmp_path, "precision.dtype=fp16", "optim.grad_clip=0", "checkpoint.every=2")
    trainer = Trainer(cfg, run_dir=tmp_path / "r")
    trainer.fit()
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss_scale"] == 2.0**16
    assert all(isinstance(c, RunContext) and c.run_dir == tmp_path / "r" for c in hooks.contexts)
    assert hooks.after_steps == [1, 2, 3, 4]
    # the after-step hook zeroed the parameters at the last step, after the optimizer had run
    assert trainer.final_state_dict and all(not v.any() for v in trainer.final_state_dict.values())
    assert hooks.sink_info.run_dir == tmp_path / "r" and hooks.sink_info.rank == 0
    assert hooks.sink_info.resume_step == 0
    assert (2, "checkpoint") in hooks.events and (4, "checkpoint") in hooks.events
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["event"]) for e in events] == [(2, "checkpoint"), (4, "checkpoint")]
    # resume: the sinks learn the resume step, and the resume is an event
    hooks.events.clear()
    Trainer(_config(tmp_path, "precision.dtype=fp16", "optim.grad_clip=0", "checkpoint.every=2",
                    "train.steps=6"), run_dir=tmp_path / "r").fit()
    assert hooks.sink_info.resume_step == 4 and hooks.events[0] == (4, "resume")



class _Failing:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    @hookimpl
    def crosstrain_on_step_end(self, context, step, metrics):
        if step == 2:
            raise RuntimeError("sink of a dashboard is down")

    @hookimpl
    def crosstrain_after_train(self, context, run_dir):
        raise ValueError("upload refused")


def test_plugin_errors_are_events(tmp_path, plugin) -> None:
    plugin(_Failing(), "failing")
    with pytest.raises(Exception, match="plugin 'failing' failed to finish after training: ValueError"):
        Trainer(_config(tmp_path), run_dir=tmp_path / "r").fit()
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    events = [e for e in events if e["event"] == "plugin_error"]
    assert [e["fatal"] for e in events] == [False, True]
    assert events[0]["plugin"] == "failing" and "dashboard is down" in events[0]["error"] and events[0]["step"] == 2
