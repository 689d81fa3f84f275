"""QAT int8 of the classify recipe under data parallelism: the activation observers take the whole data-parallel
batch's min/max (one all-reduce per observing forward), so 2 ranks -- FSDP2 (``dp_shard=2``) and DDP
(``dp_replicate=2``), real processes over gloo -- give the 1-process losses (rel 1e-5) and checkpoint the 1-process
quantiser state: every scale, zero point and observed range, weights' included (under FSDP2 the weight quantiser
sees the whole unsharded weight: its per-channel state has every output channel and equals the 1-process one).
On a group of one the reduced path is torch.ao's fused quantiser bit for bit; a 1-process run calls no collective.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from in_process import crosstrain_main
from torch import nn

pytest.importorskip("sklearn")

#: 3 steps: the layouts' weights differ in fp32 reduction order (1e-7), and under fake quantisation a weight that
#: crosses a rounding boundary moves by a whole step: measured, the first weight integer differs in step 4's forward
#: (one of the third conv's), and that step's losses are then 1.8e-5 apart; until then they agree to 1e-7
STEPS = 3
RUN = ["logging.progress=none", "backend=cpu", "eval.every=0", f"checkpoint.every={STEPS}", f"train.steps={STEPS}",
       "quant.qat=int8"]


def _argv(run: Path, *sets: str) -> list[str]:
    argv = ["train", "--recipe", "classify", "--run-dir", str(run)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _quantiser_state(run: Path) -> dict[str, torch.Tensor]:
    from crosstrain.plugins.vision.load import load_image_model

    state = load_image_model(run).model.state_dict()
    return {k: v for k, v in state.items() if "fake_quant" in k and k.rsplit(".", 1)[-1] in
            ("scale", "zero_point", "min_val", "max_val")}


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("qat_layouts") / "one"
    assert crosstrain_main(_argv(run, *RUN)) == 0
    return run


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2"], ["parallel.dp_replicate=2", "parallel.dp_shard=1"]],
                         ids=["fsdp2", "ddp"])
def test_two_ranks_observe_what_one_process_observes(one, tmp_path, layout) -> None:
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "crosstrain", *_argv(two, *RUN, *layout), "--nproc", "2"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one_s, two_s = (json.loads((r / "summary.json").read_text()) for r in (one, two))
    for setting in layout:
        dim, size = setting.removeprefix("parallel.").split("=")
        assert two_s["mesh"].get(dim, 1) == int(size), two_s["mesh"]
    assert len(one_s["losses"]) == len(two_s["losses"]) == STEPS
    for a, b in zip(one_s["losses"], two_s["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (one_s["losses"], two_s["losses"])
    want, got = _quantiser_state(one), _quantiser_state(two)
    # 4 convs (input, weight, output) + the head (input, weight): 14 quantisers, 4 tensors each
    assert len(want) == 14 * 4 and want.keys() == got.keys()
    for key, value in want.items():
        assert value.shape == got[key].shape, key  # a weight quantiser of a shard would hold half the channels
        if "zero_point" in key:
            assert torch.equal(value, got[key]), (key, value, got[key])
        else:  # measured bit-equal on this machine; 1e-6 leaves room for another conv kernel's rounding
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=0, msg=key)


def _group_of_one(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)


def test_reduced_path_is_torch_ao_bit_for_bit_on_a_group_of_one(tmp_path) -> None:
    """With a group the quantiser observes ``[global min, global max]`` then fake-quantises with the observer off;
    on a group of one that must be exactly torch.ao's single fused call: outputs, input gradients and every buffer,
    over steps whose ranges grow and shrink, the first (running min/max still inf) included, then frozen in eval."""
    from torch.ao.quantization.fake_quantize import default_fused_act_fake_quant

    from crosstrain.plugins.compress.qat.conv import ACT_FAKE_QUANT

    ours, ref = ACT_FAKE_QUANT(), default_fused_act_fake_quant()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    _group_of_one(tmp_path)
    try:
        ours.apply_data_parallel(dist.group.WORLD)
        assert copy.deepcopy(ours).dp_group is dist.group.WORLD  # a copy shares the group (which cannot be copied)
        torch.manual_seed(0)
        for step, spread in enumerate((1.0, 4.0, 0.5, 2.0, 3.0)):
            if step == 4:  # eval: ranges frozen (the conv layers' train() disables the observers likewise)
                for fq in (ours, ref):
                    fq.eval()
                    fq.disable_observer()
            x = torch.randn(4, 3, 8, 8) * spread + (step - 2)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yb = ours(xa), ref(xb)
            assert torch.equal(ya, yb), step
            weights = torch.rand_like(ya)
            (ya * weights).sum().backward()
            (yb * weights).sum().backward()
            assert torch.equal(xa.grad, xb.grad), step
            for key, value in ref.state_dict().items():
                assert torch.equal(ours.state_dict()[key], value), (step, key)
    finally:
        dist.destroy_process_group()


def test_one_process_gets_no_group_and_calls_no_collective() -> None:
    """``parallelize`` without a mesh hands no group to the quantisers (their forward is torch.ao's), and
    ``dp_group`` is None for a data-parallel degree of 1; no process group exists, so any collective would raise."""
    from crosstrain.parallel import ParallelDims, apply_data_parallel, dp_group, parallelize
    from crosstrain.plugins.compress.qat.conv import GlobalRangeActFakeQuant, quantize_convnet
    from crosstrain.plugins.compress.qat.schemes import scheme

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    quantize_convnet(model, scheme("int8"))
    assert not dist.is_initialized()
    pm = parallelize(model, ParallelDims(dp_shard=1), None, torch.device("cpu"))
    quantisers = [m for m in model.modules() if isinstance(m, GlobalRangeActFakeQuant)]
    assert len(quantisers) == 3 and all(q.dp_group is None for q in quantisers)
    assert dp_group(None, ParallelDims(dp_shard=1)) is None and apply_data_parallel(model, None) == 0
    pm.module(torch.randn(2, 1, 8, 8))  # observes locally
    assert all(q.activation_post_process.min_val.isfinite().all() for q in quantisers)
