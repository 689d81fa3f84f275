"""grpo and ppo end to end on tiny models: a GRPO run killed with SIGKILL and resumed ends with the uninterrupted
run's params_sha256 (the sampling RNG is in the checkpoint), eval_before/eval_after and the per-step
diagnostics; ppo scores with a reward model (the rm recipe's shape, from a safetensors file), trains its value
model and adapts beta as Ziegler et al.'s controller does; reward.fn resolution and its one-line errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from in_process import crosstrain_main
from run_kill import sigkill_after_checkpoint

from crosstrain.errors import ConfigError
from crosstrain.plugins.rlhf.rl.tasks import call_reward_fn, load_reward_fn, vowel_fraction

TINY = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.batch_size=8", "rl.num_generations=2",
        "rl.max_new_tokens=4", "eval.steps=1", "eval.batch_size=4", "logging.progress=none", "logging.every=1",
        "backend=cpu", "optim.lr=1e-2", "schedule.warmup_steps=1"]
DIAGNOSTICS = {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "entropy", "kl",
               "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "rollout_logprob_diff/max", "rollout_logprob_diff/mean_abs"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _cmd(recipe: str, run_dir: Path, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "crosstrain", "train", "--recipe", recipe, "--run-dir", str(run_dir)]
    for s in (*TINY, *sets):
        cmd += ["--set", s]
    return cmd


def _train(recipe: str, run_dir: Path, *sets: str) -> dict:
    """``crosstrain train`` in this process (the killed run below is a process of its own)."""
    assert crosstrain_main(_cmd(recipe, run_dir, *sets)[3:]) == 0
    return json.loads((run_dir / "summary.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_killed_and_resumed_matches_uninterrupted(tmp_path) -> None:
    sets = ("train.steps=8", "checkpoint.every=2", "eval.every=8", "rl.beta=0.05")
    ref = _train("grpo", tmp_path / "ref", *sets)
    assert ref["eval_before"]["reward_max"] == 1.0 and 0 <= ref["eval_before"]["reward_mean"] <= 1
    assert set(ref["eval_after"]) >= {"reward_mean", "reward_max", "completion_length"}
    assert ref["models"]["reference"]["trainable"] is False
    first = _metrics(tmp_path / "ref")[0]
    assert DIAGNOSTICS <= set(first)
    assert first["rollout_logprob_diff/max"] < 1e-4 and first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy = ref
    run = tmp_path / "killed"
    sigkill_after_checkpoint(_cmd("grpo", run, *sets), run, 4, _env(), timeout_s=200)
    resumed = _train("grpo", run, *sets)
    assert resumed["steps"] == 8 and resumed["steps_this_run"] < 8
    assert resumed["params_sha256"] == ref["params_sha256"]
    assert [m["reward"] for m in _metrics(run)][-4:] == [m["reward"] for m in _metrics(tmp_path / "ref")][-4:]


def test_ppo_with_a_reward_model_and_adaptive_kl(tmp_path) -> None:
    from safetensors.torch import save_file

    from crosstrain.config import load_config
    from crosstrain.plugins.rlhf.rl.recipe import scalar_head_gpt

    torch.manual_seed(0)  # a reward model in the shape --recipe rm trains (the GPT with a Linear(dim, 1) head)
    rm = scalar_head_gpt(load_config(None, TINY))
    save_file({k: v.contiguous() for k, v in rm.state_dict().items()}, str(tmp_path / "rm.safetensors"))
    horizon, n = 100.0, 8  # 8 completions a step; KL << target: the error clips at -0.2
    ppo = _train("ppo", tmp_path / "ppo", f"reward.model={tmp_path / 'rm.safetensors'}", "train.steps=3",
                 "eval.every=3", "rl.beta=0.1", "rl.kl_target=1000", f"rl.kl_horizon={horizon}", "rl.kl_in=reward",
                 "reward.max=5", "rl.stop=")
    assert ppo["models"]["reward"]["trainable"] is False and ppo["models"]["value"]["trainable"] is True
    ms = _metrics(tmp_path / "ppo")
    assert {"loss/value", "val/clipfrac", "beta"} <= set(ms[0]) and DIAGNOSTICS <= set(ms[0])
    for a, b in zip(ms, ms[1:], strict=False):
        assert b["beta"] == pytest.approx(a["beta"] * (1 - 0.2 * n / horizon), rel=1e-6)
    assert ppo["rl"]["beta_final"] == pytest.approx(ms[-1]["beta"] * (1 - 0.2 * n / horizon), rel=1e-6)
    assert ms[0]["reward"] != ms[1]["reward"] or ms[0]["reward_std"] > 0  # reward-model scores, not constants
    assert ms[0]["loss/value"] > 0 and "reward_mean" in ppo["eval_after"] and ppo["eval_after"]["reward_max"] == 5
    assert all(m["completions/mean_length"] == 4 and m["completions/clipped_ratio"] == 1 for m in ms)  # no stop


def first_char_is_a(completions, prompts):  # a reward.fn for the test below
    return [float(c[:1] == "a") for c in completions]


def length_and_prompt(completions, prompts):  # a reward.fn for tests/test_rlhf_rl_parity.py
    return [len(c) + 0.01 * len(p) for c, p in zip(completions, prompts, strict=True)]


def test_reward_fn_resolution_and_errors() -> None:
    fn = load_reward_fn("test_rlhf_rl_recipes:first_char_is_a")
    assert call_reward_fn(fn, "t", ["ab", "ba", ""], ["p", "p", "p"]) == [1.0, 0.0, 0.0]
    assert vowel_fraction(["aXe", "", "xyz"], ["p"] * 3) == [2 / 3, 0.0, 0.0]
    for spec, match in (("nocolon", "must look like"), ("no_such_mod_xyz:f", "cannot import"),
                        ("json:nope", "has no attribute"), ("json:__doc__", "not callable")):
        with pytest.raises(ConfigError, match=match) as e:
            load_reward_fn(spec)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="returned 1 rewards for 2 completions"):
        call_reward_fn(lambda c, p: [0.0], "t", ["a", "b"], ["p", "p"])
    with pytest.raises(ConfigError, match="non-finite"):
        call_reward_fn(lambda c, p: [float("nan")], "t", ["a"], ["p"])
