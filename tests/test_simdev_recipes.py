"""Every shipped recipe besides lm (sft, rm, dpo, grpo, ppo, distill), LoRA, QAT, the export written at the end of
training and ``crosstrain eval`` on simdev (a software device whose tensors are not host memory) equal the cpu
backend: same losses and eval figures (fp32, ``kernels.mode=reference``, ``optim.impl=torch``; asserted to rel
1e-6), the same ``params_sha256``, the same exported bytes, and for grpo/ppo the same rollouts (rewards and
completion lengths of tokens generated on the device). simdev is a test device, not hardware: this proves these
paths never assume the host, not anything about a chip. The default lm run and the layouts are
tests/test_simdev_train.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from simdev_env import crosstrain_on, needs_simdev

BACKENDS = ("cpu", "simdev")


pytestmark = needs_simdev

COMMON = ["model.n_layers=1", "model.dim=32", "model.n_heads=2", "train.batch_size=4", "train.seq_len=32",
          "train.steps=3", "eval.every=3", "eval.max_batches=1", "eval.batch_size=4", "checkpoint.every=0",
          "logging.progress=none", "logging.tensorboard=false", "precision.dtype=fp32", "kernels.mode=reference",
          "optim.impl=torch", "optim.lr=1e-2", "schedule.warmup_steps=1"]
PAIRS = ["rlhf.max_length=64", "rlhf.max_prompt_length=48"]
RL = ["rl.num_generations=2", "rl.max_new_tokens=4"]
#: name -> (recipe, keys); distill runs after these (its teacher is the cpu sft run)
CASES = {
    "sft": ("sft", [*PAIRS, "export.safetensors=true"]),
    "rm": ("rm", PAIRS),
    # LoRA adapters and int8 fake quantisation in one run; the export merges the adapters into plain weights
    "dpo_lora_qat": ("dpo", [*PAIRS, "lora.rank=2", "quant.qat=int8", "export.safetensors=true"]),
    "grpo": ("grpo", [*RL, "rl.beta=0.05"]),
    "ppo": ("ppo", RL),
}


def _both(argv_for: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """One ``crosstrain`` process per backend, side by side (the pair shares the machine's two cores)."""
    procs = {b: crosstrain_on(b, argv) for b, argv in argv_for.items()}
    done = {}
    for b, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[b] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert proc.returncode == 0, f"{proc.args}\n{out}\n{err}"
    return done


def _train_both(root: Path, name: str, recipe: str, keys: list[str]) -> None:
    sets = [arg for key in (*COMMON, *keys) for arg in ("--set", key)]
    _both({b: ["train", "--recipe", recipe, "--run-dir", str(root / b / name), *sets] for b in BACKENDS})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("simdev_recipes")
    for name, (recipe, keys) in CASES.items():
        _train_both(root, name, recipe, keys)
    _train_both(root, "distill", "distill", [f"distill.teacher={root / 'cpu' / 'sft'}", "distill.top_k_logits=16"])
    return root


def _summary(root: Path, backend: str, name: str) -> dict:
    summary = json.loads((root / backend / name / "summary.json").read_text())
    assert summary["backend"] == backend
    return summary


def _metrics(root: Path, backend: str, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / backend / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", [*CASES, "distill"])
def test_recipe_on_simdev_equals_cpu(root, name):
    cpu, sim = _summary(root, "cpu", name), _summary(root, "simdev", name)
    assert len(sim["losses"]) == len(cpu["losses"]) == 3
    assert sim["losses"] == pytest.approx(cpu["losses"], rel=1e-6)
    assert sim["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-6)
    assert sim["params_sha256"] == cpu["params_sha256"]
    for key in ("eval_before", "eval_after"):  # the recipes' own eval figures (rewards, accuracies, win rates)
        assert sim.get(key, {}) == pytest.approx(cpu.get(key, {}), rel=1e-6)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_rollouts_generated_on_simdev_equal_cpu(root, name):
    # the reward and lengths are functions of the sampled tokens: equal per step means the same completions
    keys = ("reward", "completions/mean_length", "kl", "entropy")
    cpu, sim = _metrics(root, "cpu", name), _metrics(root, "simdev", name)
    assert len(sim) == len(cpu) == 3
    for c, s in zip(cpu, sim, strict=True):
        shared = [k for k in keys if k in c]
        assert "reward" in shared and "completions/mean_length" in shared
        assert [s[k] for k in shared] == pytest.approx([c[k] for k in shared], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", ["sft", "dpo_lora_qat"])
def test_export_written_on_simdev_equals_the_cpu_runs(root, name):
    # written from the device-resident model at the end of training (LoRA merged), copied to the host explicitly
    from safetensors import safe_open

    files = {}
    for b in BACKENDS:
        with safe_open(str(root / b / name / "export" / "model.safetensors"), framework="pt") as fh:
            meta = {k: v for k, v in (fh.metadata() or {}).items() if k != "crosstrain.source"}  # the run dir
            files[b] = (meta, {k: fh.get_tensor(k) for k in fh.keys()})
    (cpu_meta, cpu), (sim_meta, sim) = files["cpu"], files["simdev"]
    assert sim_meta == cpu_meta and sorted(sim) == sorted(cpu)
    for key, tensor in cpu.items():
        assert sim[key].dtype == tensor.dtype and torch.equal(sim[key], tensor), key


def test_eval_on_simdev_equals_cpu(root):
    out = _both({b: ["eval", str(root / b / "sft"), "--json"] for b in BACKENDS})
    cpu, sim = (json.loads(out[b].stdout.strip().splitlines()[-1]) for b in BACKENDS)
    assert (cpu["backend"], sim["backend"]) == BACKENDS
    assert sim["step"] == cpu["step"] == 3
    assert sim["loss"] == pytest.approx(cpu["loss"], rel=1e-6)
    assert sim["loss"] == pytest.approx(_summary(root, "simdev", "sft")["eval_loss"], rel=1e-6)
