"""The sft, rm and dpo recipes end to end on tiny models: eval_before/eval_after, model.init_from from a run dir
and a safetensors file, DPO loss and weights equal on 1 vs 2 FSDP2 ranks and for grad_accum 1 vs 4 (fp32, 1e-5),
the precomputed reference's run-dir cache (reused on resume, equal on 2 ranks, stale one recomputed), a DPO run
killed with SIGKILL and resumed ends with the uninterrupted run's params_sha256, and LoRA DPO (1 and 2 FSDP2
ranks) trains the adapters only and ``crosstrain export`` writes merged weights with the adapted model's logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from in_process import crosstrain_main
from run_kill import sigkill_after_checkpoint

from crosstrain.config import gpt_config, load_config
from crosstrain.errors import ConfigError

TINY = ["model.n_layers=2", "model.dim=32", "model.n_heads=2", "train.batch_size=4", "train.steps=8",
        "rlhf.max_length=64", "rlhf.max_prompt_length=48", "rlhf.max_new_tokens=4", "eval.every=4", "eval.steps=1",
        "eval.batch_size=4", "logging.progress=none", "logging.every=1", "backend=cpu", "optim.lr=1e-2",
        "export.safetensors=true", "schedule.warmup_steps=2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _cmd(recipe: str, run_dir: Path, *sets: str, nproc: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "crosstrain", "train", "--recipe", recipe, "--run-dir", str(run_dir)]
    for s in (*TINY, *sets):
        cmd += ["--set", s]
    return cmd + (["--nproc", str(nproc)] if nproc > 1 else [])


def _train(recipe: str, run_dir: Path, *sets: str, nproc: int = 1) -> dict:
    """``crosstrain train`` on ``nproc`` ranks: several through the CLI's launcher, one in this process."""
    cmd = _cmd(recipe, run_dir, *sets, nproc=nproc)
    if nproc > 1:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert crosstrain_main(cmd[3:]) == 0
    return json.loads((run_dir / "summary.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("rlhf") / "sft"
    summary = _train("sft", run)
    assert summary["recipe"] == "sft"
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"]
    assert summary["rlhf_data"]["truncated_rows"] > 0  # 48-token prompts + completions > max_length 64
    # a token-NLL loss (loss_is_token_nll): perplexity is exp(loss)
    assert summary["eval_after"]["perplexity"] == pytest.approx(math.exp(summary["eval_after"]["loss"]))
    return run


def test_dpo_from_sft_run_matches_on_two_ranks_and_with_grad_accum(sft_run, tmp_path, capsys) -> None:
    init = (f"model.init_from={sft_run}", "optim.name=sgd")  # SGD: weights move linearly with the gradients
    one = _train("dpo", tmp_path / "one", *init)
    assert one["init_from"]["source"].endswith("step_8") and one["init_from"]["format"] == "crosstrain"
    assert one["models"]["reference"]["trainable"] is False
    assert one["eval_before"]["preference_accuracy"] == 0.5 and one["eval_before"]["loss"] == pytest.approx(
        math.log(2), abs=1e-6)  # the policy starts equal to its reference
    first = _metrics(tmp_path / "one")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == 0.0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"} <= set(first)
    assert "win_rate" in one["eval_after"]
    # the DPO loss is no token NLL: no perplexity, in summary.json nor in metrics.jsonl
    assert "perplexity" not in one["eval_before"] and "perplexity" not in one["eval_after"]
    assert not any("eval/perplexity" in m for m in _metrics(tmp_path / "one"))
    _check_mfu_counts_the_frozen_reference(one)
    capsys.readouterr()
    assert crosstrain_main(["eval", str(tmp_path / "one")]) == 0
    printed = capsys.readouterr().out
    assert "loss" in printed and "perplexity" not in printed, printed

    pre = _train("dpo", tmp_path / "pre", *init, "rlhf.reference=precomputed")
    assert "models" not in pre and len(pre["reference_logps_sha256"]) == 64
    for a, b in zip(one["losses"], pre["losses"], strict=True):  # the same objective, reference in other batches
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))
    _check_reference_cache(tmp_path, init, pre)

    two = _train("dpo", tmp_path / "two", *init, "parallel.dp_shard=2", nproc=2)
    accum = _train("dpo", tmp_path / "accum", *init, "train.grad_accum=4")
    assert two["mesh"]["dp_shard"] == 2
    w1 = _weights(tmp_path / "one")
    for other, run in ((two, "two"), (accum, "accum")):
        for a, b in zip(one["losses"], other["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), run
        for ma, mb in zip(_metrics(tmp_path / "one"), _metrics(tmp_path / run), strict=True):
            assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5, abs=1e-6), run
            assert ma["tokens"] == mb["tokens"], run  # real tokens summed over the ranks (padding is per rank)
        w2 = _weights(tmp_path / run)
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-5)


def _check_mfu_counts_the_frozen_reference(summary: dict) -> None:
    """MFU's FLOPs per token: the policy's forward + backward (6N + 12 L D T, PaLM's estimate) plus the frozen
    reference's forward only (a third of that), where N counts the non-embedding parameters."""
    from crosstrain.models.gpt import GPT

    cfg = load_config(None, list(TINY))
    model = GPT(gpt_config(cfg))
    n = sum(p.numel() for name, p in model.named_parameters() if name != "tok_embeddings.weight")
    train = 6 * n + 12 * model.config.n_layers * model.config.dim * cfg.train.seq_len
    counted = summary["mfu_flops"]
    assert counted["policy"] == {"trainable": True, "flops_per_token": train,
                                 "counted": "forward + backward: the model's flops_per_token"}
    assert counted["reference"] == {"trainable": False, "flops_per_token": pytest.approx(train / 3),
                                    "counted": "forward only: a third of the model's flops_per_token"}
    peak = summary["peak_flops"]["flops"]
    assert summary["mfu"] == pytest.approx(train * 4 / 3 * summary["tokens_per_s"] / peak, rel=1e-9)


def _events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == name]


def _check_reference_cache(tmp_path: Path, init: tuple[str, ...], pre: dict) -> None:
    """The precomputed reference is cached in the run dir, read back on resume (not recomputed), the same on 2
    FSDP2 ranks, and a stale cache (other rlhf.max_length) is recomputed with a warning on a fresh run."""
    run = tmp_path / "pre"
    cache, meta = run / "reference_logps.safetensors", run / "reference_logps.json"
    assert [e["source"] for e in _events(run, "reference_logps")] == ["computed"]
    record = json.loads(meta.read_text())
    assert record["logps_sha256"] == pre["reference_logps_sha256"] and record["rows"]["train"] > 0
    assert record["options"]["max_length"] == 64 and len(record["weights_sha256"]) == 64
    stamps = (cache.stat().st_mtime_ns, meta.stat().st_mtime_ns)
    resumed = _train("dpo", run, *init, "rlhf.reference=precomputed", "train.steps=9")
    assert resumed["steps"] == 9 and resumed["reference_logps_sha256"] == pre["reference_logps_sha256"]
    assert [e["source"] for e in _events(run, "reference_logps")] == ["computed", "cache"]
    assert (cache.stat().st_mtime_ns, meta.stat().st_mtime_ns) == stamps

    two = _train("dpo", tmp_path / "pre2", *init, "rlhf.reference=precomputed", "parallel.dp_shard=2", nproc=2)
    assert two["reference_logps_sha256"] == pre["reference_logps_sha256"]  # chunks dealt to ranks, gathered
    for a, b in zip(pre["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))

    stale = tmp_path / "stale"
    stale.mkdir()
    for f in (cache, meta):
        (stale / f.name).write_bytes(f.read_bytes())
    proc = subprocess.run(_cmd("dpo", stale, *init, "rlhf.reference=precomputed", "rlhf.max_length=60",
                               "train.steps=1", "eval.every=0"), capture_output=True, text=True, env=_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference log-prob cache" in proc.stderr and "stale (data_sha256, options changed)" in proc.stderr
    assert [e["source"] for e in _events(stale, "reference_logps")] == ["computed"]
    assert json.loads((stale / meta.name).read_text())["options"]["max_length"] == 60


def test_rm_from_safetensors_file(sft_run, tmp_path) -> None:
    file = sft_run / "export" / "model.safetensors"
    rm = _train("rm", tmp_path / "rm", f"model.init_from={file}", "rlhf.center_rewards_coefficient=0.01",
                "export.safetensors=false")  # the exporter writes GPTs with an LM head, not reward models
    assert rm["init_from"]["source"] == str(file.resolve())
    assert {"accuracy", "margin"} <= set(rm["eval_after"]) and 0 <= rm["eval_after"]["accuracy"] <= 1
    assert "perplexity" not in rm["eval_after"]  # a Bradley-Terry loss is no token NLL


def test_init_from_errors_are_one_line(sft_run, tmp_path) -> None:
    from crosstrain.recipes.lm import build_model

    sets = [s for s in TINY if not s.startswith("model.dim")]
    # the shape comes from the sft run's config.json: a key that contradicts it names the source's shape
    with pytest.raises(ConfigError, match=r"model.dim=64 does not match .* dim=32, n_layers=2.*; remove model.d") as e:
        load_config(None, [*sets, "model.dim=64", f"model.init_from={sft_run}"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        build_model(load_config(None, [*TINY, f"model.init_from={tmp_path / 'nope.safetensors'}"]))


def test_dpo_killed_and_resumed_matches_uninterrupted(tmp_path) -> None:
    sets = ("train.steps=20", "checkpoint.every=2", "model.dim=64", "model.n_heads=4", "train.batch_size=8",
            "eval.every=0")
    ref = _train("dpo", tmp_path / "ref", *sets)
    run = tmp_path / "killed"
    sigkill_after_checkpoint(_cmd("dpo", run, *sets), run, 4, _env(), timeout_s=600)  # bounds a failure only
    resumed = _train("dpo", run, *sets)
    assert resumed["steps"] == 20 and resumed["steps_this_run"] < 20
    assert resumed["params_sha256"] == ref["params_sha256"]


def test_lora_dpo_trains_adapters_only_and_exports_merged(sft_run, tmp_path) -> None:
    from crosstrain.checkpoint.consolidate import load_consolidated

    run = tmp_path / "lora"
    sets = (f"model.init_from={sft_run}", "lora.rank=4", "train.steps=4", "optim.name=sgd")
    summary = _train("dpo", run, *sets)
    two = _train("dpo", tmp_path / "lora2", *sets, "parallel.dp_shard=2", nproc=2)  # adapters under FSDP2
    for a, b in zip(summary["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a))
    assert "models" not in summary  # one model: the reference is the policy with its adapters off
    assert summary["eval_before"]["preference_accuracy"] == 0.5
    start, saved = load_consolidated(sft_run / "checkpoints"), load_consolidated(run / "checkpoints")
    assert any(k.endswith(".lora_B") and v.abs().max() > 0 for k, v in saved.items())
    for name, value in start.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)  # the base stays frozen
    merged = _weights(run)
    assert sorted(merged) == sorted(start)  # a plain GPT
    assert any(not torch.equal(merged[k], start[k]) for k in start)
    for name, value in _weights(tmp_path / "lora2").items():
        torch.testing.assert_close(value, merged[name], rtol=1e-5, atol=1e-5)
    _check_lora_export(run, saved, merged, tmp_path)


def _check_lora_export(run: Path, saved: dict[str, torch.Tensor], merged: dict[str, torch.Tensor],
                       tmp_path: Path) -> None:
    """``crosstrain export`` of the LoRA run (safetensors and hf) writes the merged weights, and the exported
    model's logits equal the trained model's (base + adapters) within 1e-5."""
    from crosstrain.cli.main import main
    from crosstrain.models.gpt import GPT
    from crosstrain.plugins.export.loading import load_model
    from crosstrain.plugins.rlhf.lora import add_lora, merge_lora

    loaded = load_model(run)
    adapted = GPT(loaded.config)
    add_lora(adapted, rank=4, alpha=16.0, dropout=0.0, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    adapted.load_state_dict(saved, strict=True)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted.eval()(tokens)
    by_hand = merge_lora(saved, 16.0 / 4)
    for fmt, out in (("safetensors", tmp_path / "lora.safetensors"), ("hf", tmp_path / "lora-hf")):
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0
        model = load_model(out).model
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, by_hand[name], rtol=0, atol=1e-6, msg=f"{fmt} {name}")
            torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6, msg=f"{fmt} {name}")
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), want, rtol=0, atol=1e-5, msg=fmt)
