"""OffloadOptimizer: fp32 master weights and states on the host, the fused kernel, low-precision params back."""

from __future__ import annotations

import json

import pytest
import shared_ranks
import torch

from crosstrain.optim.offload import OffloadOptimizer
from crosstrain.optim.reference import adamw_step


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step % 2)  # two fixed batches: the loss must fall
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 32, generator=g).to(dtype)
    y = torch.randn(16, 8, generator=g)
    return (model(x).float() - y).pow(2).mean()


@pytest.mark.parametrize("stage", [False, True], ids=["host", "staged"])
def test_bf16_model_trains_with_fp32_masters_matching_a_reference(stage):
    model = _model(torch.bfloat16)
    ref_model = _model(torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=stage)
    # reference: fp32 masters updated by the pure-torch reference op, bf16 params = rounded masters
    masters = [p.detach().float() for p in ref_model.parameters()]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    losses = []
    for step in range(1, 21):
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        _loss(ref_model, step).backward()
        with torch.no_grad():
            for p, m, (ea, eas) in zip(ref_model.parameters(), masters, moments, strict=True):
                adamw_step(m, p.grad.float(), ea, eas, step=step, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
                           weight_decay=0.1)
                p.copy_(m)
                p.grad = None
    for p, m in zip(model.parameters(), masters, strict=True):
        state = opt.state[p]
        assert state["master"].dtype == torch.float32 and state["master"].device.type == "cpu"
        torch.testing.assert_close(state["master"], m, rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), state["master"].to(torch.bfloat16))  # params are the rounded masters
    assert losses[-1] < 0.7 * losses[0]
    report = opt.memory_report()
    n = sum(p.numel() for p in model.parameters())
    assert report["offload_host_bytes"] == 3 * 4 * n  # master + exp_avg + exp_avg_sq
    assert report["offload_staging_bytes"] == (2 * 2 * n if stage else 0)  # bf16 grad + bf16 param buffers
    assert report["offload_device_bytes_saved"] == 0  # the parameters live on the host here


def test_staged_and_host_paths_agree_for_fp32_and_sgd():
    results = []
    for stage in (False, True):
        model = _model(torch.float32)
        opt = OffloadOptimizer(model.parameters(), name="sgd", lr=0.05, momentum=0.9, nesterov=True,
                               weight_decay=0.01, stage=stage)
        for step in range(1, 11):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    ref = _model(torch.float32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    for step in range(1, 11):
        _loss(ref, step).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b, r in zip(*results, ref.parameters(), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r.detach(), rtol=1e-5, atol=1e-6)


def test_config_construction_lr_changes_and_state_dict_round_trip():
    from crosstrain.config.schema import OptimConfig

    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), offload=True)
    from crosstrain.optim.factory import build_optimizer

    model = _model(torch.bfloat16)
    opt = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
    assert isinstance(opt, OffloadOptimizer)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]  # no decay on biases
    for step in range(1, 4):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    clone = _model(torch.bfloat16)
    clone.load_state_dict(model.state_dict())
    opt2 = OffloadOptimizer(list(clone.parameters()), cfg)
    opt2.load_state_dict(opt.state_dict())
    for p in clone.parameters():
        assert all(opt2.state[p][k].dtype == torch.float32 for k in ("master", "exp_avg", "exp_avg_sq"))
    for group in opt.param_groups + opt2.param_groups:  # a schedule changing lr is honoured
        group["lr"] = 5e-3
    for m, o in ((model, opt), (clone, opt2)):
        _loss(m, 9).backward()
        o.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["master"], opt2.state[b]["master"])
        assert opt2.state[b]["step"].item() == 4


def test_bad_names_and_dtypes_are_config_errors():
    from crosstrain.errors import ConfigError

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="cannot be offloaded"):
        OffloadOptimizer([p], name="lamb")
    with pytest.raises(ConfigError, match="fp32/bf16/fp16"):
        OffloadOptimizer([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


SMALL = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu", "schedule.name=constant",
         "schedule.warmup_steps=0"]  # constant lr: a 4-step run is the first half of an 8-step run


def _trainer_config(tmp_path, *extra: str):
    from crosstrain.config import load_config

    return load_config(None, [*SMALL, f"train.output_dir={tmp_path / 'runs'}", *extra])


def test_trainer_with_offload_matches_on_device_optimizer_and_resumes_exactly(tmp_path):
    from crosstrain.engine import Trainer

    plain = Trainer(_trainer_config(tmp_path, "train.steps=8"), run_dir=tmp_path / "plain").fit()
    offload = Trainer(_trainer_config(tmp_path, "train.steps=8", "optim.offload=true"), run_dir=tmp_path / "off").fit()
    assert len(offload["losses"]) == 8 and offload["final_loss"] < offload["initial_loss"]
    last = json.loads((tmp_path / "off" / "metrics.jsonl").read_text().splitlines()[-1])
    from crosstrain.models.gpt import build_gpt

    n_params = build_gpt("tiny").num_params()  # the default preset
    assert last["offload_host_bytes"] == 3 * 4 * n_params  # fp32 master + two moments per parameter, on the host
    assert last["offload_device_bytes_saved"] == 0  # on the CPU backend the parameters already live on the host
    torch.testing.assert_close(torch.tensor(offload["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-5)
    # checkpoint at step 4 (masters + states through DCP), then resume to step 8: identical to the straight run
    first = Trainer(_trainer_config(tmp_path, "train.steps=4", "optim.offload=true", "checkpoint.every=4"),
                    run_dir=tmp_path / "resumed").fit()
    assert first["steps"] == 4
    second = Trainer(_trainer_config(tmp_path, "train.steps=8", "optim.offload=true", "checkpoint.every=4"),
                     run_dir=tmp_path / "resumed").fit()
    assert second["steps_this_run"] == 4
    assert second["losses"] == offload["losses"][4:]
    assert second["params_sha256"] == offload["params_sha256"]


def _fsdp_offload_save_and_reload(collective, folder: str) -> dict:
    from crosstrain.checkpoint.app_state import ModelOptimizerState
    from crosstrain.checkpoint.manager import CheckpointManager
    from crosstrain.models.gpt import build_gpt
    from crosstrain.parallel import ParallelDims, build_mesh, dp_rank_and_size, parallelize

    dims = ParallelDims(world_size=collective.world_size, dp_shard=2).resolve()
    mesh = build_mesh(collective, dims)
    dp_rank, dp_size = dp_rank_and_size(mesh, dims)

    def build(seed: int, offload: bool):
        torch.manual_seed(seed)
        pm = parallelize(build_gpt("tiny"), dims, mesh, torch.device("cpu"), precision="fp32")
        params = list(pm.parameters())
        opt = (OffloadOptimizer(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1) if offload
               else torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1))
        return pm, opt

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 256, (4, 17), generator=g) for _ in range(6)]

    def steps(pm, opt, chunk):
        losses = []
        for tokens in chunk:
            x, y = tokens[:, :-1], tokens[:, 1:]
            opt.zero_grad(set_to_none=True)
            loss, _ = pm.forward_backward(x[dp_rank * 2:(dp_rank + 1) * 2].contiguous(),
                                          y[dp_rank * 2:(dp_rank + 1) * 2].contiguous())
            opt.step()
            losses.append(float(loss))
        return losses

    ref = steps(*build(0, False), batches)
    pm, opt = build(0, True)
    before = steps(pm, opt, batches[:3])
    mgr = CheckpointManager(folder, collective=collective)
    mgr.save(3, {"app": ModelOptimizerState(pm.module, opt)})
    mgr.wait()
    after = steps(pm, opt, batches[3:])
    pm2, opt2 = build(1, True)  # different init: everything must come from the checkpoint
    assert mgr.load(mgr.latest(), {"app": ModelOptimizerState(pm2.module, opt2)}) == 3
    mgr.close()
    resumed = steps(pm2, opt2, batches[3:])
    local = {n: float(t.norm()) for n, t in ((k, s["exp_avg"]) for k, s in enumerate(opt2.state.values()))}
    return {"ref": ref, "offload": before + after, "resumed": resumed, "norms": local}


def test_fsdp_offload_matches_adamw_and_checkpoints_each_ranks_shard(tmp_path):

    results = shared_ranks.run(_fsdp_offload_save_and_reload, str(tmp_path / "ckpt"), timeout=300)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["offload"]), torch.tensor(r["ref"]), rtol=1e-5, atol=1e-5)
        assert r["resumed"] == r["offload"][3:]
    assert results[0]["norms"] != results[1]["norms"]  # each rank restored its own shard of the states
