"""LoRA adapters: a fresh adapter is the identity, switching adapters off gives the base model, merging gives
the adapted model, and a LoRA DPO run trains the adapters only, with no reference copy."""

import torch

from crosstrain.models.gpt import build_gpt
from crosstrain.plugins.rlhf.lora import LoRALinear, adapters_disabled, add_lora, merge_lora


def test_lora_identity_disable_and_merge():
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=1, dim=32, n_heads=2)
    tokens = torch.randint(0, 256, (2, 7))
    base = model(tokens)
    adapted = add_lora(model, rank=4, alpha=8, dropout=0.0, targets=["wq", "wv", "w2"])
    assert adapted == ["layers.0.attention.wq", "layers.0.attention.wv", "layers.0.feed_forward.w2"]
    torch.testing.assert_close(model(tokens), base)  # B = 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B)
    changed = model(tokens)
    assert not torch.allclose(changed, base)
    with adapters_disabled(model):
        torch.testing.assert_close(model(tokens), base)
    merged = build_gpt("tiny", n_layers=1, dim=32, n_heads=2)
    merged.load_state_dict(merge_lora(model.state_dict(), scaling=8 / 4))
    torch.testing.assert_close(merged(tokens), changed, rtol=1e-5, atol=1e-5)


def test_all_linear_on_the_gpt_is_the_default_set_with_or_without_experts():
    """``"all-linear"`` on the GPT adapts the default targets' layers: not the output head, and not an MoE layer's
    router (read as a weight in fp32, never called, so an adapter there would silently do nothing)."""
    from crosstrain.config import load_config
    from crosstrain.engine.models import transform_model
    from crosstrain.recipes.lm import build_model

    for moe in ([], ["moe.experts=4"]):
        sets = ["train.recipe=sft", "lora.rank=2", "model.n_layers=2", "model.dim=32", "model.n_heads=2", *moe]
        default = transform_model(build_model(load_config(None, sets)), "policy", load_config(None, sets))
        every = load_config(None, [*sets, 'lora.targets=["all-linear"]'])
        model = transform_model(build_model(every), "policy", every)
        adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
        assert adapted == sorted(n for n, m in default.named_modules() if isinstance(m, LoRALinear)), moe
        assert adapted and not any(n == "output" or n.endswith("router") for n in adapted)
        if moe:
            assert any(n.endswith("router") for n, _ in model.named_modules())
