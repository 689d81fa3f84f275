"""The generic path (issue 29): any decoder-only causal LM transformers builds, trained under crosstrain's loop.

Each family's test model is a random tiny one built with transformers' own config class, its norms and biases
moved off their init values (so a mapping that dropped them would show), saved sharded with ``save_pretrained``.
Checked: seven non-native families train from ``model.init_from`` with the loss falling; FSDP2 (per decoder layer,
with activation checkpointing), DDP and tensor parallelism through ``base_model_tp_plan`` on 2 real ranks give the
1-process losses (rel 1e-4), and so does GRPO (rollouts generated on the sharded policy); bf16 under FSDP2 stays
within 2e-2 of the fp32 losses; sft, LoRA dpo, rm, grpo and ppo run; the exported folder loads in transformers with
the trained weights (same params_sha256, logits within 1e-5, the same greedy tokens as ``crosstrain generate``); a
resumed run ends with the uninterrupted run's params_sha256; refusals are one line; ``crosstrain models`` lists
every family.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import shared_ranks
import torch
from causal_check import prefix_moves
from in_process import crosstrain_main
from one_line import raises_one_line

pytest.importorskip("transformers")

REL = 1e-4
SHAPE = {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LAYERS = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "max_position_embeddings": 128}
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt_neox": {**LAYERS, "intermediate_size": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "olmo2": {**LAYERS, "num_key_value_heads": 2, "intermediate_size": 64},
    "falcon": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_dropout": 0.0,
               "attention_dropout": 0.0},
    "phi": {**LAYERS, "intermediate_size": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "stablelm": {**LAYERS, "num_key_value_heads": 2, "intermediate_size": 64},
    "bloom": {"hidden_size": 32, "n_layer": 2, "n_head": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "starcoder2": {**LAYERS, "num_key_value_heads": 2, "intermediate_size": 64, "residual_dropout": 0.0,
                   "embedding_dropout": 0.0},
}
BASE = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "schedule.warmup_steps=0", "backend=cpu",
        "optim.lr=3e-3", "eval.every=0", "checkpoint.every=0"]


def _save_family(model_type: str, folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **FAMILIES[model_type]))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms and biases off their init (ones / zeros)
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="40KB")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for model_type in FAMILIES:
        _save_family(model_type, root / model_type)
        out[model_type] = root / model_type
    assert (out["gpt_neox"] / "model.safetensors.index.json").is_file()  # sharded
    return out


def _sets(folder: Path, *extra: str) -> list[str]:
    # olmo2 may become native (issue 29's native families): ask for the generic path explicitly there
    source = ["model.source=transformers"] if folder.name == "olmo2" else []
    return [*BASE, f"model.init_from={folder}", *source, *extra]


def _fit(sets: list[str], out: Path) -> dict[str, Any]:
    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    return Trainer(load_config(None, [*sets, f"train.output_dir={out}"]), run_dir=out).fit()


def test_every_family_attends_causally(folders: dict[str, Path]) -> None:
    """Next-token training must not see the future: for every family, crosstrain's model of the folder keeps the
    prefix logits unchanged when the suffix changes (issue 40: an encoder trained as a causal LM moved them)."""
    from crosstrain.config import load_config
    from crosstrain.recipes.lm import build_model

    for model_type, folder in folders.items():
        model = build_model(load_config(None, [f"model.init_from={folder}", "model.source=transformers"])).eval()
        assert prefix_moves(model) == 0.0, model_type


def _one_process(sets: list[str], out: Path) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(sets, out)
    finally:
        torch.set_num_threads(threads)


# -- training from model.init_from, every family ---------------------------------------------------------------------
def test_every_family_trains_from_init_from_with_the_loss_falling(folders: dict[str, Path], tmp_path: Path) -> None:
    from crosstrain.config import load_config
    from crosstrain.models.family import family_for_run

    for model_type, folder in folders.items():
        sets = _sets(folder, "train.steps=8")
        assert family_for_run(load_config(None, sets)).name == "generic"
        summary = _one_process(sets, tmp_path / model_type)
        losses = summary["losses"]
        assert losses[-1] < losses[0] - 0.1, f"{model_type}: {losses}"
        assert summary["init_from"]["model_type"] == model_type


# -- 2 ranks against 1 process -----------------------------------------------------------------------------------------
def _layouts(folders: dict[str, Path]) -> dict[str, list[str]]:
    neox = _sets(folders["gpt_neox"], "train.steps=4")
    return {
        "fsdp": [*neox, "parallel.dp_shard=2", "parallel.activation_checkpoint=full"],
        "ddp": [*neox, "parallel.dp_replicate=2", "parallel.dp_shard=1"],
        "bf16": [*neox, "parallel.dp_shard=2", "precision.dtype=bf16"],  # FSDP2 gathers bf16 parameters
        "tp": [*_sets(folders["starcoder2"], "train.steps=4"), "parallel.tp=2", "parallel.dp_shard=1"],
        # rollouts generate on the FSDP2-sharded policy (transformers' cache through the gathered model)
        "grpo": [*_grpo(folders), "parallel.dp_shard=2"],
    }


def _grpo(folders: dict[str, Path]) -> list[str]:
    return _sets(folders["gpt_neox"], "train.recipe=grpo", "train.steps=2", "train.seq_len=64", "train.batch_size=8")


def _fit_all(collective: Any, root: str, layouts: dict[str, list[str]]) -> dict[str, Any]:
    out = {}
    for name, sets in layouts.items():
        summary = _fit(sets, Path(root) / name)
        out[name] = {"losses": summary["losses"], "mesh": summary["mesh"]}
    return out


def test_two_ranks_match_one_process(folders: dict[str, Path], tmp_path: Path) -> None:
    layouts = _layouts(folders)
    rank0, rank1 = shared_ranks.run(_fit_all, str(tmp_path / "ranks"), layouts, timeout=400)
    assert rank0 == rank1
    refs = {"neox": _one_process(_sets(folders["gpt_neox"], "train.steps=4"), tmp_path / "ref_neox")["losses"],
            "starcoder2": _one_process(_sets(folders["starcoder2"], "train.steps=4"), tmp_path / "ref_sc")["losses"]}
    assert rank0["fsdp"]["mesh"]["dp_shard"] == 2 and rank0["tp"]["mesh"]["tp"] == 2
    for name, ref in (("fsdp", refs["neox"]), ("ddp", refs["neox"]), ("tp", refs["starcoder2"])):
        got = rank0[name]["losses"]
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, ref, strict=True))
        assert worst <= REL, f"{name}: max rel loss diff {worst:.2e}: {got} vs one process {ref}"
    bf16 = max(abs(g - w) / w for g, w in zip(rank0["bf16"]["losses"], refs["neox"], strict=True))
    assert bf16 <= 2e-2, f"bf16 under FSDP2 is {bf16:.2e} off the fp32 losses"  # bf16 rounding, not another model
    grpo = _one_process(_grpo(folders), tmp_path / "ref_grpo")["losses"]  # near 0: compared absolutely
    assert max(abs(g - w) for g, w in zip(rank0["grpo"]["losses"], grpo, strict=True)) <= 1e-5


# -- recipes ---------------------------------------------------------------------------------------------------------
def test_every_recipe_runs_on_the_generic_path(folders: dict[str, Path], tmp_path: Path) -> None:
    """sft, LoRA dpo, and rm / grpo / ppo (their scalar heads swapped on the transformers model, generation through
    transformers' cache) on GPT-NeoX."""
    neox = folders["gpt_neox"]
    sft = _one_process(_sets(neox, "train.recipe=sft", "train.steps=3", "train.seq_len=64"), tmp_path / "sft")
    assert len(sft["losses"]) == 3 and all(torch.isfinite(torch.tensor(sft["losses"])))
    dpo = _one_process(_sets(neox, "train.recipe=dpo", "train.steps=3", "train.seq_len=64", "lora.rank=4",
                             'lora.targets=["query_key_value", "dense"]'), tmp_path / "dpo")
    assert len(dpo["losses"]) == 3
    assert abs(dpo["losses"][0] - 0.6931) < 1e-3  # LoRA starts as the base: policy == reference, loss = log 2
    for recipe in ("rm", "grpo", "ppo"):
        summary = _one_process(_sets(neox, f"train.recipe={recipe}", "train.steps=2", "train.seq_len=64"),
                               tmp_path / recipe)
        assert len(summary["losses"]) == 2 and all(torch.isfinite(torch.tensor(summary["losses"]))), recipe


# -- export, generation, resume --------------------------------------------------------------------------------------
def test_export_loads_in_transformers_and_resume_is_exact(folders: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from crosstrain.engine.state import params_sha256
    from crosstrain.plugins.export.loading import load_model

    sets = _sets(folders["gpt_neox"], "train.steps=6", "checkpoint.every=3")
    straight = _one_process(sets, tmp_path / "straight")
    step_3 = tmp_path / "straight" / "checkpoints" / "step_3"
    resumed = _one_process([*sets, f"checkpoint.resume={step_3}"], tmp_path / "resumed")
    assert resumed["steps_this_run"] == 3 and resumed["params_sha256"] == straight["params_sha256"]

    out = tmp_path / "hf"
    assert crosstrain_main(["export", str(tmp_path / "straight"), "--format", "hf", "--out", str(out),
                            "--max-shard-size", "40KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert params_sha256(hf.state_dict()) == straight["params_sha256"]  # the trained weights, bit for bit
    ours = load_model(tmp_path / "straight").model
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5

    prompt = [5, 17, 99, 3]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert crosstrain_main(["generate", str(out), "--prompt-ids", ",".join(map(str, prompt)),
                                "--max-new-tokens", "16", "--json"]) == 0
    new = json.loads(stdout.getvalue().strip().splitlines()[-1])["new_ids"]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert new == want
    from crosstrain.generation import GenerationConfig, generate

    raises_one_line(lambda: generate(ours, [prompt], GenerationConfig(max_new_tokens=2, compile=True)), "make_static")


# -- selection and refusals ------------------------------------------------------------------------------------------
def test_source_picks_the_path_and_refusals_are_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    from crosstrain.config import check_static, check_world, load_config
    from crosstrain.models.family import family_for_run

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256, **LAYERS,
                                                   "intermediate_size": 64}))
    assert family_for_run(load_config(None, [f"model.init_from={llama}"])).name == "gpt"  # auto: native
    assert family_for_run(load_config(None, [f"model.init_from={llama}", "model.source=transformers"])).name == (
        "generic")
    assert family_for_run(load_config(None, ["model.source=transformers"])).name == "generic"  # a preset's Llama

    neox, falcon = folders["gpt_neox"], folders["falcon"]
    from crosstrain.models.family import param_count
    from crosstrain.models.generic.wrapper import GenericCausalLM
    from crosstrain.recipes.lm import build_model

    bare = tmp_path / "config_only"  # a config.json and no weights: random weights from the run's seed
    bare.mkdir()
    (bare / "config.json").write_text((neox / "config.json").read_text())
    config = load_config(None, [f"model.init_from={bare}"])
    model = build_model(config)
    assert isinstance(model, GenericCausalLM) and type(model).__name__ == "GPTNeoXForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == param_count(config)  # the family's meta-device count
    raises_one_line(lambda: check_world(load_config(None, _sets(neox, "parallel.pp=2")), 2), "parallel.pp=2",
                    "generic", "parallel.pp=1")
    raises_one_line(lambda: check_world(load_config(None, _sets(falcon, "parallel.tp=2")), 2), "parallel.tp=2",
                    "base_model_tp_plan", "parallel.tp=1")
    raises_one_line(lambda: check_static(load_config(None, _sets(neox, "data.packing=documents"))),
                    "data.packing", "concat")
    raises_one_line(lambda: check_static(load_config(None, _sets(neox, "model.source=native"))), "gpt_neox")
    raises_one_line(lambda: check_static(load_config(None, _sets(neox, "model.dim=64"))), "model.dim",
                    "init_from")
    from crosstrain.engine.models import transform_model

    lora = load_config(None, _sets(neox, "train.recipe=sft", "lora.rank=4"))  # the native names (wq, ...) by default
    raises_one_line(lambda: transform_model(build_model(lora), "policy", lora), "query_key_value", "dense_4h_to_h")


def test_models_command_lists_every_family_from_its_bundle(plugin: Any) -> None:
    import test_models_family as toy

    plugin(toy.ToyPlugin(), "toy-family")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert crosstrain_main(["models", "--json"]) == 0
    found = {f["family"]: f for f in json.loads(stdout.getvalue())["families"]}
    assert found["gpt"]["path"] == "native" and "llama" in found["gpt"]["model_types"]
    assert "ep" in found["gpt"]["parallel_dims"]  # the MoE plugin's extension adds it
    generic = found["generic"]
    assert generic["path"] == "generic" and "gpt_neox" in generic["model_types"]
    assert "llama" not in generic["model_types"] and "pp" not in generic["parallel_dims"]
    assert "parallel.pp > 1" in generic["refuses"]
    assert found["toy"]["path"] == "native" and found["toy"]["presets"] == ["toy"]


def test_lora_all_linear_adapts_every_linear_layer_but_the_head(folders: dict[str, Path]) -> None:
    """``lora.targets=["all-linear"]`` (PEFT's): on every generic family each ``nn.Linear`` but the output head gets
    an adapter and only the adapters train; a reward model's scalar head stays trainable and unadapted. Falcon's
    layers are ``FalconLinear`` (a subclass with its own forward), which LoRA leaves alone: refused in one line."""
    from torch import nn

    from crosstrain.config import load_config
    from crosstrain.engine.models import transform_model
    from crosstrain.models.family import swap_scalar_head
    from crosstrain.plugins.rlhf.lora import LoRALinear
    from crosstrain.recipes.lm import build_model

    for family, folder in folders.items():
        for recipe, name in (("sft", "policy"), ("rm", "reward")):
            config = load_config(None, _sets(folder, f"train.recipe={recipe}", "lora.rank=2",
                                             'lora.targets=["all-linear"]'))
            model = build_model(config)
            if recipe == "rm":
                swap_scalar_head(model, "normal", who="test")
            head = model.get_output_embeddings()
            linear = {n for n, m in model.named_modules() if type(m) is nn.Linear and m is not head}
            if family == "falcon":
                assert not linear
                raises_one_line(lambda m=model, n=name, c=config: transform_model(m, n, c), "FalconLinear",
                                "lora.rank=0")
                continue
            assert linear, family
            model = transform_model(model, name, config)
            adapted = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
            assert adapted == linear, (family, recipe)
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            lora = {f"{n}.lora_{ab}" for n in linear for ab in "AB"}
            head_names = {n for n, p in model.named_parameters() if any(p is q for q in head.parameters())}
            assert head_names and not head_names & lora
            assert trainable == lora | (head_names if recipe == "rm" else set()), (family, recipe)
