"""Checkpoint interface conformance: the backend's checkpointer round-trips device tensors and JSON state."""

from __future__ import annotations

import torch


def test_round_trip(backend, device, tmp_path):
    ckpt = backend.checkpointer()
    dev = device.current_device()
    state = {
        "model": {"w": torch.randn(3, 5, device=dev), "b": torch.arange(4, device=dev, dtype=torch.int64)},
        "optim": {"step": 7, "lrs": [0.1, 0.01], "name": "adamw", "flag": True, "none": None},
        "bf16": torch.randn(6, device=dev).to(torch.bfloat16),
    }
    handle = ckpt.save(state, tmp_path / "step_1")
    handle.wait()
    assert ckpt.exists(tmp_path / "step_1")
    assert not ckpt.exists(tmp_path / "missing")
    loaded = ckpt.load(tmp_path / "step_1")
    assert torch.equal(loaded["model"]["w"].cpu(), state["model"]["w"].cpu())
    assert torch.equal(loaded["model"]["b"].cpu(), state["model"]["b"].cpu())
    assert loaded["bf16"].dtype == torch.bfloat16 and torch.equal(loaded["bf16"].cpu(), state["bf16"].cpu())
    assert loaded["optim"] == state["optim"]

    target = {"model": {"w": torch.zeros(3, 5, device=dev), "b": torch.zeros(4, device=dev, dtype=torch.int64)}}
    ckpt.load(tmp_path / "step_1", target)
    assert target["model"]["w"].device.type == device.type
    assert torch.equal(target["model"]["w"].cpu(), state["model"]["w"].cpu())
