"""QAT with LoRA (torchtune's QAT + LoRA recipe): the frozen base path fake-quantised, the adapters' update from the
unquantised input added in floating point. The layer against the closed form (forward and the adapters' gradients),
each half switched off on its own, and an sft run with both that trains the adapters only and exports, merged, to
an int8 ONNX model that passes its parity gate."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from in_process import crosstrain_main
from torch import nn

from crosstrain.plugins.compress.qat.fake_quant import fake_quant_per_token, fake_quant_weight
from crosstrain.plugins.compress.qat.linear import FakeQuantLinear, fake_quant_disabled, quantize_linears
from crosstrain.plugins.compress.qat.schemes import scheme
from crosstrain.plugins.rlhf.lora import LoRALinear, adapters_disabled, add_lora


def test_the_layer_is_the_fake_quantised_base_plus_the_float_adapter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    add_lora(model, rank=4, alpha=8, dropout=0.0, targets=["0"])
    layer = model[0]
    with torch.no_grad():
        layer.lora_B.normal_()  # a trained adapter (a fresh one is zero)
    s = scheme("int8-act-int4-weight", 32)
    assert quantize_linears(model, s) == ["0"]
    assert isinstance(layer, FakeQuantLinear) and isinstance(layer, LoRALinear)
    x = torch.randn(3, 5, 64, requires_grad=True)
    base = nn.functional.linear(fake_quant_per_token(x, 8), fake_quant_weight(layer.weight, 4, 32), layer.bias)
    adapter = (x @ layer.lora_A.t() @ layer.lora_B.t()) * 2.0
    out = layer(x)
    torch.testing.assert_close(out, base + adapter, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    # only the adapters train; their gradients are the float adapter's (the quantised base does not enter them)
    assert layer.weight.grad is None and layer.lora_A.grad is not None
    xa = x.detach()
    torch.testing.assert_close(layer.lora_B.grad, 2.0 * (upstream.reshape(-1, 32).t() @ (xa @ layer.lora_A.t().detach()
                                                                                          ).reshape(-1, 4)),
                               rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        with adapters_disabled(model):
            torch.testing.assert_close(layer(x), base)
        with fake_quant_disabled(model):
            torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias) + adapter)


SFT = ("train.recipe=sft", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu",
       "train.steps=6", "eval.every=0", "model.n_layers=1", "model.dim=64", "model.n_heads=2", "lora.rank=4",
       "quant.qat=int8", "optim.lr=1e-2", "schedule.warmup_steps=0")


def test_the_plugins_compose_lora_then_qat_on_the_policy() -> None:
    from crosstrain.config import load_config
    from crosstrain.engine.models import transform_model
    from crosstrain.recipes.lm import build_model

    config = load_config(None, list(SFT))
    model = transform_model(build_model(config), "policy", config)
    adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted and all(isinstance(model.get_submodule(n), FakeQuantLinear) for n in adapted)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{n}.lora_{ab}" for n in adapted for ab in "AB"}


def test_sft_with_lora_and_qat_trains_the_adapters_and_exports_quantised(tmp_path: Path, capsys) -> None:
    from crosstrain.plugins.export.loading import load_model

    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run)]
    for s in SFT:
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["losses"][-1] < summary["losses"][0]
    trained = load_model(run).model  # the consolidated run, adapters merged into plain weights
    assert not any("lora" in name for name in trained.state_dict())
    out = tmp_path / "model.onnx"
    capsys.readouterr()
    assert crosstrain_main(["export", str(run), "--quantize", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["scheme"] == "int8" and report["parity"]["passed"], report
