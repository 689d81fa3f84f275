"""The Trainer in-process: run dir outputs, determinism, exact resume, non-finite handling, hooks, user models."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import shared_ranks
import torch
from nan_steps import NaNSteps

from crosstrain import hookimpl, pluginmanager
from crosstrain.config import load_config
from crosstrain.engine import Trainer, TrainingError
from crosstrain.errors import ConfigError
from crosstrain.recipes.lm import LMRecipe

SMALL = ["train.steps=8", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu",
         "schedule.warmup_steps=2"]


def _config(tmp_path, *extra: str):
    return load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'runs'}", *extra])


def test_run_dir_outputs_and_determinism(tmp_path) -> None:
    threads = torch.get_num_threads()
    summary = Trainer(_config(tmp_path)).fit()
    assert torch.get_num_threads() == threads  # the trainer's thread setting does not leak
    run = tmp_path / "runs"
    (run_dir,) = list(run.iterdir())
    assert summary["run_dir"] == str(run_dir)
    assert {p.name for p in run_dir.iterdir()} >= {"config.toml", "config.json", "metrics.jsonl", "summary.json"}
    written = json.loads((run_dir / "summary.json").read_text())
    for key in ("backend", "world_size", "mesh", "steps", "initial_loss", "final_loss", "tokens_per_s", "mfu",
                "peak_memory_bytes", "wall_s", "params_sha256"):
        assert key in written, key
    assert written["backend"] == "cpu" and written["world_size"] == 1 and written["steps"] == 8
    assert written["final_loss"] < written["initial_loss"] and written["tokens_per_s"] > 0
    assert written["peak_memory_bytes"] > 0 and len(written["params_sha256"]) == 64
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "time_data_s", "time_forward_s",
                "time_backward_s", "time_optimizer_s", "peak_memory_bytes"):
        assert key in lines[0], key
    assert [x["loss"] for x in lines] == summary["losses"]
    saved = load_config(run_dir / "config.toml", [])
    assert saved.train.steps == 8 and saved.train.output_dir == str(run)
    # same layout and seed twice: the same parameters bit for bit; another seed: different ones
    again = Trainer(_config(tmp_path), run_dir=tmp_path / "again").fit()
    assert again["params_sha256"] == summary["params_sha256"] and again["losses"] == summary["losses"]
    other = Trainer(_config(tmp_path, "train.seed=1"), run_dir=tmp_path / "other").fit()
    assert other["params_sha256"] != summary["params_sha256"]


class _Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])


class _PreemptAt:
    """Acts like a SIGTERM arriving during step ``at`` (sets the watcher's flag the signal handler sets)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.extra = _Counter()

    @hookimpl
    def crosstrain_on_step_end(self, context, step, metrics):
        self.extra.value += 1
        if step == self.at:
            context.request_stop("test preemption")


class _CountingLM(LMRecipe):
    """``lm`` with extra checkpointed state: the recipe's ``state()`` is saved and restored with the run."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def state(self):
        return {"demo_counter": self.counter}


def test_preempt_and_resume_is_exact(tmp_path, plugin) -> None:
    reference = Trainer(_config(tmp_path, "train.steps=10"), run_dir=tmp_path / "ref").fit()
    hook = plugin(_PreemptAt(4), "preempt-at-4")
    cfg = _config(tmp_path, "train.steps=10", "checkpoint.every=3")
    first = Trainer(cfg, run_dir=tmp_path / "run", recipe=_CountingLM(hook.extra)).fit()
    assert first["preempted"] is True and first["steps"] == 4
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_3", "step_4"]
    hook.at = -1
    hook.extra.value = 100  # restored from the checkpoint through the recipe's state()
    second = Trainer(cfg, run_dir=tmp_path / "run", recipe=_CountingLM(hook.extra)).fit()
    assert second["steps_this_run"] == 6 and second["preempted"] is False
    assert hook.extra.value == 4 + 6
    assert second["losses"] == reference["losses"][4:]
    assert second["params_sha256"] == reference["params_sha256"]
    assert second["initial_loss"] == reference["initial_loss"]
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


def _weights(context) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in context.models["model"].state_dict().items()}


def test_nonfinite_step_is_skipped(tmp_path, plugin) -> None:
    plugin(NaNSteps({3}), "nan-at-3")
    snapshots = {}

    class Snap:
        @hookimpl
        def crosstrain_on_step_end(self, context, step, metrics):
            snapshots[step] = _weights(context)

    plugin(Snap(), "snap")
    summary = Trainer(_config(tmp_path, "train.recipe=lm_nan"), run_dir=tmp_path / "r").fit()
    assert summary["nonfinite_steps"] == 1 and summary["steps"] == 8 and summary["rollbacks"] == 0
    assert all(torch.equal(snapshots[2][k], snapshots[3][k]) for k in snapshots[2])  # step 3 changed nothing
    assert any(not torch.equal(snapshots[3][k], snapshots[4][k]) for k in snapshots[3])
    assert math.isfinite(summary["final_loss"])
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("skipped", 0) for x in lines] == [0, 0, 1, 0, 0, 0, 0, 0]


def test_consecutive_nonfinite_rolls_back_or_fails(tmp_path, plugin) -> None:
    plugin(NaNSteps({5, 6}), "nan-5-6")
    cfg = _config(tmp_path, "train.recipe=lm_nan", "fault.max_consecutive_nonfinite=2", "checkpoint.every=4")
    summary = Trainer(cfg, run_dir=tmp_path / "r").fit()
    assert summary["rollbacks"] == 1 and summary["nonfinite_steps"] == 2 and summary["steps"] == 8
    with pytest.raises(TrainingError, match="no checkpoint to roll back to"):
        Trainer(_config(tmp_path, "train.recipe=lm_nan", "fault.max_consecutive_nonfinite=2"),
                run_dir=tmp_path / "r2").fit()


def test_grad_accumulation_matches_one_big_batch(tmp_path) -> None:
    one = Trainer(_config(tmp_path, "train.batch_size=8", "train.steps=5"), run_dir=tmp_path / "a").fit()
    acc = Trainer(_config(tmp_path, "train.batch_size=8", "train.grad_accum=2", "train.steps=5"),
                  run_dir=tmp_path / "b").fit()
    assert len(one["losses"]) == 5
    for x, y in zip(one["losses"], acc["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(x)


class _Hooks:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sink_steps: list[int] = []

    @hookimpl
    def crosstrain_transform_model(self, model, config):
        self.calls.append("transform_model")
        model.transformed_by_plugin = True
        return model

    @hookimpl
    def crosstrain_metrics_sinks(self, config):
        hooks = self

        class Sink:
            def write(self, step, metrics):
                hooks.sink_steps.append(step)

            def close(self):
                hooks.calls.append("sink_closed")

        return [Sink()]

    @hookimpl
    def crosstrain_after_train(self, context, run_dir):
        self.calls.append("after_train")
        assert (context.run_dir / "summary.json").exists() and run_dir == str(context.run_dir)
        assert set(context.final_state_dict) >= {"tok_embeddings.weight", "output.weight"}


def test_hooks_are_called(tmp_path, plugin) -> None:
    hooks = plugin(_Hooks(), "hooks")
    trainer = Trainer(_config(tmp_path, "train.steps=3"), run_dir=tmp_path / "r")
    trainer.fit()
    assert hooks.calls == ["transform_model", "after_train", "sink_closed"]  # sinks hear after-train events
    assert hooks.sink_steps == [1, 2, 3]
    assert getattr(trainer.model, "transformed_by_plugin", False)


def test_user_model_by_import_path(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "usermodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mine.py").write_text(textwrap.dedent("""
        from crosstrain.models.gpt import GPT, GPTConfig

        def build(section):
            return GPT(GPTConfig(dim=section.options["dim"], n_layers=1, n_heads=2, max_seq_len=64))

        def not_a_module(section):
            return 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = Trainer(_config(tmp_path, "model.import_path=usermodels.mine:build", "model.options.dim=16"),
                      run_dir=tmp_path / "r").fit()
    assert summary["final_loss"] < summary["initial_loss"]
    with pytest.raises(ConfigError, match="not a torch.nn.Module"):
        Trainer(_config(tmp_path, "model.import_path=usermodels.mine:not_a_module"), run_dir=tmp_path / "x").fit()
    with pytest.raises(ConfigError, match="cannot import"):
        Trainer(_config(tmp_path, "model.import_path=usermodels.nope:build"), run_dir=tmp_path / "y").fit()
    assert not (tmp_path / "y").exists()


def test_low_precision_runs(tmp_path) -> None:
    for dtype in ("bf16", "fp16"):
        summary = Trainer(_config(tmp_path, f"precision.dtype={dtype}", "train.steps=4"),
                          run_dir=tmp_path / dtype).fit()
        assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < summary["initial_loss"]
    lines = (tmp_path / "fp16" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["loss_scale"] == 2.0**16


def test_world_size_errors_write_nothing(tmp_path) -> None:
    with pytest.raises(ConfigError, match="world size is 1"):
        Trainer(_config(tmp_path, "parallel.dp_replicate=2", "parallel.dp_shard=1")).fit()
    with pytest.raises(ConfigError, match="checkpoint.resume"):
        Trainer(_config(tmp_path, "checkpoint.resume=/nonexistent/ckpt")).fit()
    assert not (tmp_path / "runs").exists()


def _fsdp_twice(collective, opts: list[str], out: str) -> list[dict]:
    results = []
    for i in range(2):
        s = Trainer(load_config(None, opts), run_dir=f"{out}/run{i}").fit()
        results.append({"losses": s["losses"], "sha": s["params_sha256"], "mesh": s["mesh"]})
    return results


def test_fsdp_two_ranks_is_deterministic_and_matches_single_process(tmp_path) -> None:
    opts = [*SMALL, "train.steps=6", "parallel.dp_shard=2"]
    rank0, rank1 = shared_ranks.run(_fsdp_twice, opts, str(tmp_path / "fsdp"), timeout=300)
    first, second = rank0
    assert first["mesh"]["dp_shard"] == 2
    assert first["sha"] == second["sha"] == rank1[0]["sha"]  # same layout and seed: identical parameters
    assert first["losses"] == second["losses"] == rank1[0]["losses"]
    single = Trainer(load_config(None, [*SMALL, "train.steps=6"]), run_dir=tmp_path / "single").fit()
    assert len(single["losses"]) == 6
    for a, b in zip(single["losses"], first["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)


def test_schedules_and_optimizer_groups() -> None:
    from crosstrain.config.schema import OptimConfig, ScheduleConfig
    from crosstrain.optim.factory import build_optimizer
    from crosstrain.optim.schedules import build_schedule, lr_factor

    kw = {"total_steps": 110, "warmup_steps": 10, "min_lr_ratio": 0.1}
    assert [lr_factor(s, name="cosine", **kw) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, name="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(60, name="cosine", **kw) == pytest.approx(0.55)
    assert lr_factor(110, name="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(60, name="linear", **kw) == pytest.approx(0.55)
    assert lr_factor(35, name="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_factor(80, name="constant", **kw) == 1.0
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model.parameters(), OptimConfig(lr=0.5, weight_decay=0.2), None)
    assert isinstance(opt, torch.optim.AdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # weight matrix vs biases/norm
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    sched = build_schedule(opt, ScheduleConfig(name="linear", warmup_steps=2, min_lr_ratio=0.0), 4)
    lrs = []
    for _ in range(4):
        lrs.append(sched.lr)
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.5, 0.25])
    sched.load_state_dict({"step": 1})
    assert sched.lr == pytest.approx(0.5) and sched.state_dict() == {"step": 1}
    sgd = build_optimizer(model.parameters(), OptimConfig(name="sgd", lr=0.1, momentum=0.5), None)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5


def test_console_line_and_jsonl_non_finite(tmp_path) -> None:
    from crosstrain.engine.metrics import JsonlSink, format_line

    line = format_line(3, 10, {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 1234.0, "mfu": 0.05, "step_time_s": 0.1,
                               "time_data_s": 0.001, "time_forward_s": 0.04, "peak_memory_bytes": 2**30,
                               "skipped": 1.0})
    assert line.startswith("step 3/10 | loss 2.5000 | lr 1.0e-03 | 1,234 tok/s | mfu 5.0% | 100 ms (data 1 forward 40)")
    assert "mem 1,024 MB" in line and "SKIPPED" in line
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write(1, {"loss": float("nan"), "grad_norm": float("inf")})
    sink.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 1, "loss": "nan", "grad_norm": "inf"}


def test_failing_runtime_hooks_stop_the_run_naming_the_plugin(tmp_path, plugin) -> None:
    """A plugin that changes the parameters after a step (federated averaging) and raises is never skipped."""
    from crosstrain.errors import PluginError

    class BrokenAggregation:
        @hookimpl
        def crosstrain_after_optimizer_step(self, context, step):
            if step == 2:
                raise ConnectionError("aggregation server unreachable")

    plugin(BrokenAggregation(), "secagg")
    with pytest.raises(PluginError, match="plugin 'secagg' failed to act after the optimizer step: ConnectionError"):
        Trainer(_config(tmp_path), run_dir=tmp_path / "grads").fit()
    pluginmanager.unregister("secagg")

    class BrokenExport:
        @hookimpl
        def crosstrain_after_train(self, context, run_dir):
            raise ValueError("parity check failed")

    plugin(BrokenExport(), "exporter")
    with pytest.raises(PluginError, match="plugin 'exporter' failed to finish after training: ValueError"):
        Trainer(_config(tmp_path, "train.steps=2"), run_dir=tmp_path / "after").fit()
