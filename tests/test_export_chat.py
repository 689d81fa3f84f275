"""Export keeps what the model needs, and ``model.init_from`` chains (issue 38), on a Llama-3-shaped tiny model with
a Llama-3-style tokenizer (tests/chat_tokenizer.py): HF folder -> ``--recipe sft`` (init_from the folder) ->
``--recipe dpo --set model.init_from=<sft run>`` (no model.* key, no data.tokenizer) -> ``crosstrain export --format
hf``, each a real ``crosstrain`` subprocess; the exported folder under transformers renders chat prompts exactly as
the original tokenizer, its GenerationConfig lists <|eot_id|>, and ``generate`` stops there. A real mismatch names
the source's shape."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from one_line import raises_one_line
from serve_process import serve_process

from crosstrain.config import load_config

pytest.importorskip("transformers")
from chat_tokenizer import CONVERSATIONS, EOT, build_model, write_jsonl  # noqa: E402 (needs transformers)

LIMITS = ["train.seq_len=128", "rlhf.max_length=96", "rlhf.max_prompt_length=80", "train.batch_size=4",
          "logging.progress=none", "eval.every=0", "backend=cpu", "data.val_fraction=0.1"]


def _crosstrain(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "crosstrain", *args], capture_output=True, text=True, timeout=300,
                          env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]


def _train(recipe: str, run: Path, *sets: str) -> dict:
    flags = [a for s in (*LIMITS, *sets) for a in ("--set", s)]
    _crosstrain("train", "--recipe", recipe, "--run-dir", str(run), *flags)
    return json.loads((run / "summary.json").read_text())


def _turns(tokenizer) -> list[tuple[list[dict], str]]:
    """(messages before each assistant turn, that turn's content) of every conversation."""
    return [(c["messages"][:i], m["content"].strip()) for c in CONVERSATIONS
            for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """HF folder -> sft (its prompts rendered with the chat template, completions closed by <|eot_id|>) -> dpo ->
    export of each run."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chain")
    hf = build_model(root / "hf")
    tok = AutoTokenizer.from_pretrained(hf)
    turns = _turns(tok)
    sft_rows = [{"prompt": tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                 "completion": answer + EOT} for m, answer in turns]
    write_jsonl(root / "sft.jsonl", sft_rows * 4)
    write_jsonl(root / "dpo.jsonl", [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": "No." + EOT}
                                     for r in sft_rows * 4])
    _train("sft", root / "sft", f"model.init_from={hf}", f"data.tokenizer={hf}", f"data.path={root / 'sft.jsonl'}",
           "train.steps=120", "optim.lr=1e-2")
    # no model.* key and no data.tokenizer: both come from the sft run, which came from the HF folder
    _train("dpo", root / "dpo", f"model.init_from={root / 'sft'}", f"data.path={root / 'dpo.jsonl'}",
           "train.steps=2", "optim.lr=1e-4")
    for run in ("sft", "dpo"):
        _crosstrain("export", str(root / run), "--format", "hf", "--out", str(root / f"{run}_hf"))
    return {"hf": hf, "root": root, "sft": root / "sft", "dpo": root / "dpo",
            "sft_hf": root / "sft_hf", "dpo_hf": root / "dpo_hf"}


def test_export_keeps_chat_template_special_tokens_and_stop_tokens(chain: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    hf, out = chain["hf"], chain["sft_hf"]
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes(), name
    original, exported = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(out)
    eot = exported.convert_tokens_to_ids(EOT)
    assert exported.all_special_tokens == original.all_special_tokens
    gen = GenerationConfig.from_pretrained(out)
    assert eot in gen.eos_token_id and gen.eos_token_id == GenerationConfig.from_pretrained(hf).eos_token_id
    assert gen.bos_token_id == original.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    stopped, learned, replies = 0, 0, []
    turns = _turns(original)
    for messages, answer in turns:
        ids = original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == ids
        prompt = exported(ids, add_special_tokens=False, return_tensors="pt")["input_ids"]
        assert prompt[0, 0].item() == original.bos_token_id  # the template's BOS, once
        with torch.no_grad():  # generation_config.json's stop set ends the reply: no eos_token_id passed here
            new = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
        replies.append(exported.decode(new))
        stopped += new[-1] == eot and len(new) < 24
        learned += exported.decode(new[:-1]) == answer  # the fine-tuned reply, word for word
    assert stopped >= 0.9 * len(turns), f"{stopped} of {len(turns)} replies stopped at {EOT}: {replies}"
    assert learned >= len(turns) - 2, replies


def test_hf_sft_dpo_export_chain_needs_no_model_keys(chain: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    dpo = json.loads((chain["dpo"] / "config.json").read_text())
    assert dpo["data"]["tokenizer"] == str(chain["hf"])  # carried from the sft run
    assert all(dpo["model"][k] is None for k in ("dim", "n_layers", "n_heads", "vocab_size"))
    hf_config, exported = (json.loads((p / "config.json").read_text()) for p in (chain["hf"], chain["dpo_hf"]))
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert exported[key] == hf_config[key], key
    assert (chain["dpo_hf"] / "chat_template.jinja").is_file()
    model = AutoModelForCausalLM.from_pretrained(chain["dpo_hf"]).eval()
    from safetensors.torch import load_file

    # the dpo run trained the sft weights: they moved, but only a little (2 steps at lr 1e-4)
    sft, dpo = (load_file(str(chain[f"{r}_hf"] / "model.safetensors")) for r in ("sft", "dpo"))
    assert sft.keys() == dpo.keys()
    moved = max((sft[k] - dpo[k]).abs().max().item() for k in sft)
    assert 0 < moved < 0.05
    ids = torch.tensor([[0, 5, 6, 7]])
    assert model(ids).logits.shape == (1, 4, hf_config["vocab_size"])


def test_mismatch_names_the_source_shape(chain: dict[str, Path], tmp_path: Path) -> None:
    from crosstrain.recipes.lm import build_model as build

    sft, rows = chain["sft"], f"data.path={chain['root'] / 'dpo.jsonl'}"
    sets = ["train.recipe=dpo", rows, f"model.init_from={sft}"]
    text = raises_one_line(lambda: load_config(None, [*sets, "model.dim=32"]),
                           "model.dim=32", "dim=64", "n_layers=2", "n_kv_heads=2", str(chain["hf"]),
                           "remove model.dim")
    assert "set the model.* keys" not in text
    # repeating the source's own shape is fine
    cfg = load_config(None, ["train.recipe=dpo", rows, "model.dim=64", "model.n_layers=2", f"model.init_from={sft}"])
    assert cfg.data.tokenizer == str(chain["hf"])
    # a checkpoint without its run config around it: the shape is this run's model.* keys, and the error says
    # which tensor differs, the source's shape first
    step = next((sft / "checkpoints").glob("step_*"))
    bare = tmp_path / step.name
    shutil.copytree(step, bare)
    cfg = load_config(None, ["train.recipe=dpo", rows, f"data.tokenizer={chain['hf']}", f"model.init_from={bare}"])
    raises_one_line(lambda: build(cfg), "the source's layers.0.attention.wk.weight is (32, 64), this model's (64, 64)",
                    "no run config.json", "set the model.* keys")


def test_serve_chat_renders_the_runs_template_and_stops_at_its_end_of_turn(chain: dict[str, Path]) -> None:
    """``/v1/chat/completions`` on the sft run (openai SDK, a real ``crosstrain serve`` process): the prompt is the
    tokenizer's chat template with its generation prompt, the reply is what transformers' ``generate`` gives on the
    exported folder, and it ends at <|eot_id|> with finish_reason "stop"."""
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with serve_process([str(chain["sft"]), "--threads", "1", "--model-name", "sft"],
                       chain["root"] / "serve.stderr") as server:
        tok = AutoTokenizer.from_pretrained(chain["sft_hf"])
        model = AutoModelForCausalLM.from_pretrained(chain["sft_hf"]).eval()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60)
        turns = _turns(tok)
        stopped = 0
        for messages, _ in turns:
            reply = client.chat.completions.create(model="sft", messages=messages, max_tokens=24, temperature=0)
            prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False, return_tensors="pt")["input_ids"]
            assert reply.usage.prompt_tokens == prompt.shape[1]  # the template's text, BOS once
            with torch.no_grad():
                new = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
            assert reply.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
            stopped += reply.choices[0].finish_reason == "stop"
        assert stopped >= 0.9 * len(turns), f"{stopped} of {len(turns)} replies stopped"
