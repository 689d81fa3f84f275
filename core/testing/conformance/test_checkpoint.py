"""Checkpoint interface conformance: the backend's checkpointer, which every trainer checkpoint goes through,
round-trips device tensors (sharded DCP files) and JSON state, and loads back into tensors on the device."""

from __future__ import annotations

import pytest
import torch

from crosstrain.checkpoint.dcp import DCPCheckpointer
from crosstrain.checkpoint.verify import verify


# DCP's note when used without a process group; single-process use is intended here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_round_trip(backend, device, tmp_path):
    ckpt = backend.checkpointer()
    assert isinstance(ckpt, DCPCheckpointer), "CheckpointManager needs a DCPCheckpointer (or a subclass)"
    dev = device.current_device()
    model = {"w": torch.randn(3, 5, device=dev), "b": torch.arange(4, device=dev, dtype=torch.int64),
             "bf16": torch.randn(6, device=dev).to(torch.bfloat16)}
    optim = {"step": 7, "lrs": [0.1, 0.01], "name": "adamw", "flag": True, "none": None}
    ckpt.save({"model": model, "optim": optim}, tmp_path / "step_1", step=1)
    assert ckpt.exists(tmp_path / "step_1")
    assert not ckpt.exists(tmp_path / "missing")
    assert verify(tmp_path / "step_1").ok, "every file must match the manifest's SHA-256"

    target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "optim": {}}
    assert ckpt.load(tmp_path / "step_1", target) == {"step": 1}
    for key, want in model.items():
        got = target["model"][key]
        assert got.device.type == device.type and got.dtype == want.dtype, key
        assert torch.equal(got.cpu(), want.cpu()), key
    assert target["optim"] == optim
