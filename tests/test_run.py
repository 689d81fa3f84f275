"""The Run value: what ``build_run`` builds for training and for ``crosstrain eval``, and what ``close`` gives back."""

from __future__ import annotations

import pytest
import torch

from crosstrain.config import load_config
from crosstrain.engine import trainer as trainer_module
from crosstrain.engine.run import build_run
from crosstrain.errors import ConfigError

SMALL = [
    "train.steps=6",
    "train.batch_size=4",
    "train.seq_len=32",
    "logging.progress=none",
    "backend=cpu",
    "model.n_layers=2",
    "model.dim=32",
    "model.n_heads=2",
    "data.val_fraction=0.05",
    "eval.steps=2",
    "train.threads=3",
]


def _config(tmp_path, *extra: str):
    return load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'runs'}", *extra])


def test_build_run_for_training_and_for_eval(tmp_path) -> None:
    threads = torch.get_num_threads()
    run = build_run(_config(tmp_path, "eval.every=0"))
    try:
        assert torch.get_num_threads() == 3  # train.threads, until close()
        assert run.is_main and run.rank == 0 and run.world_size == 1
        assert run.trainable == [run.primary] and run.primary is run.models["model"]
        assert run.primary.optimizer is not None and run.primary.schedule is not None
        assert run.context.models["model"] is run.primary.module and run.context.optimizers["model"] is not None
        assert run.eval is None  # eval.every=0: no held-out data for a training run
        assert len(run.sampler.next_step()) == 1 and not run.scaler.enabled
    finally:
        run.close()
    assert torch.get_num_threads() == threads
    assert not (tmp_path / "runs").exists()  # building a run writes nothing

    run = build_run(_config(tmp_path, "eval.every=0", "parallel.compile=auto"), for_eval=True)
    try:
        assert run.eval is not None and run.eval.batches == 2  # built whatever eval.every says
        assert run.primary.optimizer is None  # nothing is trained
        assert not run.compile_choice.enabled and "crosstrain eval" in run.compile_choice.reason
        results = run.evaluate()
        assert results["eval/loss"] > 0 and results["eval/perplexity"] == pytest.approx(
            torch.tensor(results["eval/loss"]).exp().item(), rel=1e-5
        )
    finally:
        run.close()
    assert torch.get_num_threads() == threads


def test_a_failed_build_gives_back_what_it_changed(tmp_path) -> None:
    threads = torch.get_num_threads()
    with pytest.raises(ConfigError, match="fewer than eval.batch_size"):  # after the models (and threads) exist
        build_run(_config(tmp_path, "eval.every=2", "eval.batch_size=4000"))
    assert torch.get_num_threads() == threads


def test_crosstrain_eval_builds_no_trainer(tmp_path, monkeypatch) -> None:
    from crosstrain.engine.evaluate_checkpoint import evaluate_checkpoint

    summary = trainer_module.Trainer(
        _config(tmp_path, "eval.every=6", "checkpoint.every=6"), run_dir=tmp_path / "run"
    ).fit()

    def no_trainer(*args: object, **kwargs: object) -> None:
        raise AssertionError("crosstrain eval built a Trainer")

    monkeypatch.setattr(trainer_module.Trainer, "__init__", no_trainer)
    result = evaluate_checkpoint(
        load_config(tmp_path / "run" / "config.toml", []), tmp_path / "run" / "checkpoints" / "step_6"
    )
    assert result["step"] == 6 and abs(result["loss"] - summary["eval_loss"]) <= 1e-6
