"""Fast defaults (issue 21): optimizer impl, layout choice and compile policy; numerics against the references."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import shared_ranks
import torch

from crosstrain.config import check_world, load_config
from crosstrain.engine import Trainer, fast_defaults
from crosstrain.errors import ConfigError
from crosstrain.optim.factory import build_optimizer
from crosstrain.parallel import ParallelDims
from crosstrain.parallel.layout import choose_layout

TINY = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "logging.tensorboard=false",
        "backend=cpu", "schedule.warmup_steps=2", "eval.every=0", "model.dim=32", "model.n_layers=1",
        "model.n_heads=2", "observability.per_rank=false"]


def _optim_cfg(**kw):
    return load_config(None, [f"optim.{k}={v}" for k, v in kw.items()]).optim


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_native_optimizer_matches_torch_and_state_dicts_load_both_ways() -> None:
    from crosstrain import registry

    backend = registry.set_active_backend("cpu")
    for name in ("adamw", "sgd"):
        cfg_auto, cfg_torch = _optim_cfg(name=name, impl="auto"), _optim_cfg(name=name, impl="torch")
        fast_model, ref_model = _model(), _model()
        fast = build_optimizer(fast_model.parameters(), cfg_auto, backend=backend)
        ref = build_optimizer(ref_model.parameters(), cfg_torch, backend=backend)
        assert (fast.crosstrain_impl, ref.crosstrain_impl) == ("native", "torch")
        assert type(ref) is {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
        _train(fast_model, fast, 5)
        _train(ref_model, ref, 5)
        for a, b in zip(fast_model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the same update within fp32 rounding
        # checkpoints: each optimizer's state_dict loads into the other and training continues identically
        swapped_fast, swapped_ref = _model(), _model()
        swapped_fast.load_state_dict(ref_model.state_dict())
        swapped_ref.load_state_dict(fast_model.state_dict())
        opt_a = build_optimizer(swapped_fast.parameters(), cfg_auto, backend=backend)
        opt_b = build_optimizer(swapped_ref.parameters(), cfg_torch, backend=backend)
        opt_a.load_state_dict(copy.deepcopy(ref.state_dict()))  # a copy, as a checkpoint gives: load_state_dict
        opt_b.load_state_dict(copy.deepcopy(fast.state_dict()))  # keeps same-dtype tensors by reference
        _train(swapped_fast, opt_a, 3)
        _train(swapped_ref, opt_b, 3)
        _train(fast_model, fast, 3)
        for a, b, c in zip(swapped_fast.parameters(), swapped_ref.parameters(), fast_model.parameters(), strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_layout_choice_by_estimate_and_explicit_fsdp() -> None:
    def dims(**kw):
        return ParallelDims(world_size=2, **kw)

    gib = 2**30
    assert choose_layout(dims(), "auto", gib, 4 * gib).layout == "ddp"
    tight = choose_layout(dims(), "auto", 3 * gib, 4 * gib)
    assert tight.layout == "fsdp" and "> 50%" in tight.reason
    assert choose_layout(dims(), "auto", 0, 4 * gib).layout == "fsdp"  # unknown size: the safe choice
    assert choose_layout(dims(), "fsdp", gib, 4 * gib).layout == "fsdp"
    assert choose_layout(dims(dp_shard=2), "auto", gib, 4 * gib).layout == "fsdp"
    assert choose_layout(dims(tp=2), "ddp", gib, 4 * gib).layout == "fsdp"
    config = load_config(None, TINY)
    ddp = check_world(config, 2, 8 * gib)
    assert (ddp.dp_replicate, ddp.dp_shard) == (2, 1) and ddp.layout_choice.layout == "ddp"
    assert check_world(config, 2, 2**20).dp_shard == 2  # 1 MiB per rank: does not fit, FSDP2
    assert check_world(config, 2).dp_shard == 2  # memory unknown (the launcher's early check): FSDP2
    config.parallel.layout = "ddp"
    assert check_world(config, 2).dp_replicate == 2
    with pytest.raises(ConfigError, match="parallel.layout"):
        load_config(None, ["parallel.layout=zero3"])


def test_compile_policy(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    one, tp2 = ParallelDims(), ParallelDims(tp=2, dp_shard=1, world_size=2)
    decide = fast_defaults.decide_compile
    assert not decide("auto", one, True, 400, 0.01, "k").enabled  # 400 x 0.01 s x 15% < a cold compile
    assert decide("auto", one, True, 4000, 1.0, "k").enabled  # long run: it pays
    assert not decide("auto", tp2, True, 4000, 1.0, "k").enabled  # a layout that does not compile
    assert not decide("auto", one, False, 4000, 1.0, "k").enabled  # no block units
    assert decide(True, one, True, 1, 0.0, "k").enabled and not decide(False, one, True, 4000, 1.0, "k").enabled
    fast_defaults.write_record("k", compile_s=12.5)
    assert not decide("auto", one, True, 10, 0.01, "k").enabled  # a warm cache alone does not make it pay
    fast_defaults.write_record("k", eager_step_s=1.0, compiled_step_s=0.5)
    warm = decide("auto", one, True, 100, 0.01, "k")  # 100 x 0.5 s saved > 12.5 s measured compile
    assert warm.enabled and warm.saving_s == 50.0 and warm.estimate_s == 12.5
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()  # torch writes its /tmp default into the variable; the per-user dir still replaces it
    inductor = fast_defaults.enable_compile_caches()
    assert inductor == tmp_path / "crosstrain" / "inductor" / fast_defaults.host_isa()
    assert cache_dir() == str(inductor)  # where torch now writes its compile caches (restored by monkeypatch)


def test_compile_caches_are_kept_per_cpu_isa(tmp_path) -> None:
    """A process pinned to another ATen ISA (``ATEN_CPU_CAPABILITY``) gets its own inductor folder and record key."""
    code = ("import torch; from crosstrain.engine import fast_defaults as f; from crosstrain.parallel import "
            "ParallelDims; print(f.enable_compile_caches(), "
            "f.model_key(torch.nn.Linear(2, 2), ParallelDims(), 'fp32', 1, 8))")
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    base["XDG_CACHE_HOME"] = str(tmp_path)

    def run(env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    pinned, host = run({**base, "ATEN_CPU_CAPABILITY": "default"}), run(base)
    assert pinned[0] == str(tmp_path / "crosstrain" / "inductor" / "default")
    assert host[0] == str(tmp_path / "crosstrain" / "inductor" / fast_defaults.host_isa())
    if fast_defaults.host_isa() != "default":  # a host with vector units: the two never share kernels or records
        assert pinned[1] != host[1]


def test_fast_defaults_match_the_references_over_100_steps(tmp_path) -> None:
    """Acceptance: same seed and layout, default-fast vs torch.optim + reference kernels + no compile."""
    base = [*TINY, "train.steps=100", f"train.output_dir={tmp_path}"]
    fast = Trainer(load_config(None, base), run_dir=tmp_path / "fast").fit()
    ref = Trainer(load_config(None, [*base, "optim.impl=torch", "kernels.mode=reference", "parallel.compile=false"]),
                  run_dir=tmp_path / "ref").fit()
    written = json.loads((tmp_path / "fast" / "summary.json").read_text())
    assert written["optim_impl"] == "native" and written["defaults"]["optimizer"]["class"] == "FusedAdamW"
    assert written["defaults"]["compile"]["enabled"] is False and written["compile_s"] == 0.0
    assert written["defaults"]["kernels"]["adamw_step"] != "reference"
    assert ref["optim_impl"] == "torch" and set(ref["defaults"]["kernels"].values()) == {"reference"}
    assert len(fast["losses"]) == len(ref["losses"]) == 100
    worst = max(abs(a - b) / abs(b) for a, b in zip(fast["losses"], ref["losses"], strict=True))
    assert worst <= 1e-4, worst
    assert fast["final_loss"] < 0.8 * fast["initial_loss"]


def _two_rank_runs(collective, opts: list[str], out: str) -> dict:
    no_save = "checkpoint.final=false"
    auto = Trainer(load_config(None, [*opts, "train.steps=2", no_save]), run_dir=f"{out}/auto").fit()
    fsdp = [*opts, "parallel.layout=fsdp"]
    whole = Trainer(load_config(None, [*fsdp, "train.steps=4", no_save]), run_dir=f"{out}/whole").fit()
    Trainer(load_config(None, [*fsdp, "train.steps=2"]), run_dir=f"{out}/split").fit()  # saves its step 2
    resumed = Trainer(load_config(None, [*fsdp, "train.steps=4", no_save]), run_dir=f"{out}/split").fit()
    return {"auto": {k: auto[k] for k in ("mesh", "defaults", "optim_impl", "params_sha256")},
            "whole": {k: whole[k] for k in ("mesh", "optim_impl", "params_sha256", "losses")},
            "resumed": {k: resumed[k] for k in ("params_sha256", "losses", "steps_this_run")}}


def test_two_ranks_ddp_by_default_native_on_fsdp2_shards_and_exact_resume(tmp_path) -> None:
    rank0, rank1 = shared_ranks.run(_two_rank_runs, TINY, str(tmp_path), timeout=300)
    auto, whole, resumed = rank0["auto"], rank0["whole"], rank0["resumed"]
    assert auto["mesh"]["dp_replicate"] == 2 and auto["mesh"]["dp_shard"] == 1
    assert auto["defaults"]["layout"]["choice"] == "ddp" and "fits" in auto["defaults"]["layout"]["reason"]
    assert auto["optim_impl"] == "native"
    assert whole["mesh"]["dp_shard"] == 2 and whole["optim_impl"] == "native"  # FusedAdamW on DTensor shards
    assert resumed["steps_this_run"] == 2 and resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["losses"] == whole["losses"][2:]
    assert rank1["whole"]["params_sha256"] == whole["params_sha256"]
