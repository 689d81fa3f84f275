"""Per-family semantics follow transformers' modeling code (issue 40).

For each native family the config fields crosstrain's reader reads (declared in
:data:`crosstrain.models.hf.fields.READS`, enforced by :class:`~crosstrain.models.hf.fields.DeclaredFields`) are
compared with the fields the installed transformers uses: those its ``modeling_<family>.py`` reads (``config.X``,
``self.config.X``, ``getattr(config, "X")``, found with ``ast``; a field only stored on ``self`` under a name nothing
reads back does not count: Gemma 3's ``attn_logit_softcapping``), those the shared rope and mask code reads (the
config's own ``standardize_rope_params`` included: a top-level ``original_max_position_embeddings`` wins), and
those the family's config class folds into a read field (``rope_theta`` into ``rope_parameters``, Qwen2's
``use_sliding_window`` into ``layer_types``: checked by changing the field and watching the read one change). The test
fails on a field crosstrain reads that transformers ignores, and on a field transformers reads that crosstrain ignores
unless it is in :data:`NO_MATH` (reviewed: fields that do not change the forward pass). Then Gemma 3 with
``attn_logit_softcapping = 4.0`` gives transformers' logits within 1e-5.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from crosstrain.models.hf.config import ARCHITECTURES, gpt_config_from_hf  # noqa: E402
from crosstrain.models.hf.fields import READS, DeclaredFields  # noqa: E402

#: model_type -> (config class, modeling module name)
FAMILIES = {"llama": ("LlamaConfig", "llama"), "mistral": ("MistralConfig", "mistral"),
            "qwen2": ("Qwen2Config", "qwen2"), "qwen3": ("Qwen3Config", "qwen3"), "phi3": ("Phi3Config", "phi3"),
            "olmo2": ("Olmo2Config", "olmo2"), "smollm3": ("SmolLM3Config", "smollm3"),
            "gemma2": ("Gemma2Config", "gemma2"), "gemma3_text": ("Gemma3TextConfig", "gemma3")}
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, head_dim=8, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
#: fields transformers reads that do not change the forward pass of a causal LM, reviewed one by one
NO_MATH = {
    "_attn_implementation": "which attention kernel computes the same softmax(QK^T)V",
    "attention_dropout": "dropout: training only; crosstrain has none and warns (models.hf.config.ignored_dropout)",
    "resid_pdrop": "dropout (Phi-3), as attention_dropout",
    "pad_token_id": "nn.Embedding padding_idx: only keeps that row's gradient at zero; the forward is the same",
    "use_cache": "the KV cache returns what the full forward computes",
}
#: a crosstrain-read field transformers' config class folds into a field its modeling code reads:
#: (field, other config kwargs, value) -> the read field must change
FOLDED: dict[str, tuple[dict[str, Any], Any]] = {
    "rope_theta": ({}, 1234.0),
    "rope_scaling": ({}, {"rope_type": "linear", "factor": 2.0}),
    "partial_rotary_factor": ({}, 0.5),
    "use_sliding_window": ({"sliding_window": 8, "max_window_layers": 1}, True),
    "max_window_layers": ({"sliding_window": 8, "use_sliding_window": True}, 2),
    "no_rope_layer_interval": ({}, 2),
    "sliding_window_pattern": ({}, 3),
    "rope_local_base_freq": ({}, 1234.0),
}
#: the shared modules every family's model calls into: rotary tables, masks
SHARED = ("transformers.modeling_rope_utils", "transformers.masking_utils")
#: transformers' attention kernels read attributes of the attention module (``module.is_causal``)
KERNELS = ("sdpa_attention", "flash_attention", "flex_attention")


def _is_config(node: ast.expr, names: tuple[str, ...] = ("config",)) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute)
                                                                  and node.attr == "config")


def _loaded_attrs(module: ModuleType) -> set[str]:
    """Attribute names ``module`` reads back from anything but a config."""
    return {n.attr for n in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and not _is_config(n.value)}


def config_reads(source: ModuleType | type, loaded: set[str] | None = None,
                 names: tuple[str, ...] = ("config",)) -> set[str]:
    """The config fields ``source`` reads (``names``: what a config is called there); with ``loaded`` (attribute
    names read back anywhere), a field only copied to ``self.<name>`` under a name not in ``loaded`` is left out
    (stored, never used)."""
    tree = ast.parse(inspect.getsource(source))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        field = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_config(node.value, names):
            field = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is_config(node.args[0], names) and isinstance(node.args[1], ast.Constant)):
            field = str(node.args[1].value)
        if field is None:
            continue
        parent = parents.get(node)
        if (loaded is not None and isinstance(parent, ast.Assign) and len(parent.targets) == 1
                and isinstance(parent.targets[0], ast.Attribute) and parent.targets[0].attr not in loaded):
            continue  # e.g. self.attn_logit_softcapping = config.attn_logit_softcapping, never read back
        out.add(field)
    return out


def transformers_reads(model_type: str) -> set[str]:
    """The config attributes transformers' model of ``model_type`` reads (some of other families' configs, in the
    shared code, and methods among them)."""
    cls_name, module_name = FAMILIES[model_type]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    loaded = _loaded_attrs(modeling)
    for kernel in KERNELS:
        loaded |= _loaded_attrs(importlib.import_module(f"transformers.integrations.{kernel}"))
    fields = config_reads(modeling, loaded)
    for name in SHARED:
        fields |= config_reads(importlib.import_module(name))
    # the config's own rope code (``self`` is the config): folds top-level fields into rope_parameters
    fields |= config_reads(importlib.import_module(SHARED[0]).RotaryEmbeddingConfigMixin, names=("self",))
    if "tie_word_embeddings" in config_reads(importlib.import_module("transformers.modeling_utils")):
        fields.add("tie_word_embeddings")  # PreTrainedModel ties the head to the embedding
    return fields


def folded_into_read_field(model_type: str, field: str, read: set[str]) -> bool:
    """Changing ``field`` in transformers' config class changes a field its model reads (``FOLDED``'s probe)."""
    cls = getattr(transformers, FAMILIES[model_type][0])
    extra, value = FOLDED[field]
    if model_type == "phi3" and field == "rope_scaling":  # Phi3Config accepts longrope only
        half = SHAPE["head_dim"] // 2
        value = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    before, after = cls(**SHAPE, **extra), cls(**SHAPE, **extra, **{field: value})
    return any(getattr(before, f, None) != getattr(after, f, None) for f in read - {field})


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_crosstrain_reads_the_fields_transformers_uses(model_type: str) -> None:
    assert set(FAMILIES) == set(ARCHITECTURES)  # a new native family needs its row here
    read, ours = transformers_reads(model_type), set(READS[model_type]) - {"model_type"}
    assert {"hidden_size", "rope_parameters", "rms_norm_eps"} <= read  # the scan finds fields at all
    ignored = sorted(f for f in ours - read if not (f in FOLDED and folded_into_read_field(model_type, f, read)))
    assert not ignored, f"crosstrain reads {ignored}, which transformers' {model_type} does not use"
    theirs = read & set(getattr(transformers, FAMILIES[model_type][0])(**SHAPE).to_dict())  # this family's fields
    missing = sorted(theirs - ours - set(NO_MATH))
    assert not missing, f"transformers' {model_type} reads {missing}, which crosstrain ignores"


def _variants(model_type: str) -> list[dict[str, Any]]:
    """config.json dicts that take every branch of the reader: transformers' own, and one in v4 spelling (top-level
    rope fields, no layer_types / no_rope_layers, so the fields they are built from are read)."""
    cls = getattr(transformers, FAMILIES[model_type][0])
    v5 = {**cls(**SHAPE).to_dict(), "model_type": model_type}
    legacy = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types", "no_rope_layers")}
    legacy.update(rope_theta=5e5, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    if model_type == "gemma3_text":
        legacy["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    elif model_type == "phi3":
        half = SHAPE["head_dim"] // 2
        legacy["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
        legacy["original_max_position_embeddings"] = 64
    elif model_type != "gemma2":
        legacy["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    return [v5, legacy]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_reader_reads_exactly_its_declared_fields(model_type: str) -> None:
    read: set[str] = set()
    for cfg in _variants(model_type):
        view = DeclaredFields(cfg, model_type)
        gpt_config_from_hf(view)
        read |= view.read
    assert read == set(READS[model_type])
    with pytest.raises(LookupError, match="attn_logit_softcapping"):  # an undeclared read fails at once
        DeclaredFields({"attn_logit_softcapping": 4.0}, "gemma3_text").get("attn_logit_softcapping")


def test_gemma3_attention_softcapping_gives_transformers_logits(tmp_path: Path) -> None:
    """transformers' Gemma 3 stores ``attn_logit_softcapping`` and never applies it; crosstrain computes the same."""
    from crosstrain.kernels import registry
    from crosstrain.models.hf import load_pretrained

    cfg = transformers.Gemma3TextConfig(**{**SHAPE, "vocab_size": 320, "num_hidden_layers": 2},
                                        attn_logit_softcapping=4.0, query_pre_attn_scalar=8, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    ref = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(0.3, 0.1)
        for layer in ref.model.layers:  # large q/k so that a cap at 4 would change the scores
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.attn_softcap == 0.0
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), registry.use_reference():
        got, want = ours(ids), ref(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_gemma3_model_with_attention_softcapping_is_not_exported_as_gemma3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' Gemma 3 would drop the cap: ``export --format hf`` refuses in one line, nothing
    written; without the cap the same model exports as gemma3_text."""
    from crosstrain.cli.main import main
    from crosstrain.models.gpt import GPT, GPTConfig
    from crosstrain.plugins.export.loading import LoadedModel, save_safetensors, tokenizer_metadata

    cfg = GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, qk_norm="head", sandwich_norm=True,
                    norm_plus_one=True, embed_scale=True, mlp_act="gelu_tanh", tie_embeddings=True, attn_softcap=4.0)
    for c, name in ((cfg, "capped"), (dataclasses.replace(cfg, attn_softcap=0.0), "plain")):
        save_safetensors(LoadedModel(GPT(c), c, tokenizer_metadata(c), name), tmp_path / f"{name}.safetensors")
    capsys.readouterr()
    capped = ["export", str(tmp_path / "capped.safetensors"), "--format", "hf", "--out", str(tmp_path / "a")]
    assert main(capped) == 6  # ExportError's exit code: the model cannot be exported in this format
    err = capsys.readouterr().err.strip()
    assert "attn_logit_softcapping" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a").exists()
    assert main(["export", str(tmp_path / "plain.safetensors"), "--format", "hf", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model_type"] == "gemma3_text"


def test_a_top_level_original_context_wins_as_in_transformers(tmp_path: Path) -> None:
    """transformers' ``standardize_rope_params`` gives a top-level ``original_max_position_embeddings`` priority
    over ``rope_parameters``' own for llama3/yarn/longrope (not only Phi-3's): a Llama yarn config.json with 32 at
    the top and 128 inside gives transformers' logits (1e-5) in crosstrain."""
    from crosstrain.kernels import registry
    from crosstrain.models.hf import load_pretrained

    cfg = transformers.LlamaConfig(**{**SHAPE, "vocab_size": 320},
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["rope_parameters"]["original_max_position_embeddings"] = 128
    (tmp_path / "config.json").write_text(json.dumps({**saved, "original_max_position_embeddings": 32}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert ref.config.rope_parameters["original_max_position_embeddings"] == 32
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 32
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), registry.use_reference():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-5, rtol=0)
