"""MoE models trace to ONNX (the layer's static-shape export path) and onnxruntime matches PyTorch within the
export plugin's default tolerance (1e-4), prefill and decode with the KV cache (measured: 1.2e-6)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")


def test_moe_gpt_exports_to_onnx_with_runtime_parity(tmp_path):
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.export.onnx_export import trace_to_onnx
    from crosstrain.plugins.export.parity import check_parity
    from crosstrain.plugins.moe import to_moe
    from crosstrain.plugins.moe.config import MoESection

    torch.manual_seed(0)
    model = to_moe(build_gpt("tiny", n_layers=2, max_seq_len=32),
                   MoESection(experts=4, top_k=2, shared_experts=1), seed=1).eval()
    path = tmp_path / "moe.onnx"
    trace_to_onnx(model, path, {"crosstrain.source": "test"})
    report = check_parity(model, path, tolerance=1e-4)
    assert report.passed and report.max_abs_err <= 1e-4, report.describe()


def test_moe_run_exports_through_the_training_transforms(tmp_path):
    """`crosstrain export RUN` rebuilds the MoE layers from the run's config before loading the weights."""
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer
    from crosstrain.plugins.export.loading import load_model

    cfg = load_config(None, ["train.steps=2", "train.batch_size=4", "train.seq_len=32", "logging.progress=none",
                             "backend=cpu", "model.n_layers=2", "moe.experts=4", "moe.top_k=2", "eval.every=0",
                             "checkpoint.final=true"])
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.fit()
    loaded = load_model(tmp_path / "run")
    state = loaded.model.state_dict()
    assert any("experts" in k for k in state)
    for name, tensor in trainer.final_state_dict.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
