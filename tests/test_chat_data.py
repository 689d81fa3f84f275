"""Conversation data through the tokenizer's own chat template (issue 38): on a Llama-3-style tokenizer built
locally (tests/chat_tokenizer.py), ``crosstrain data show --recipe sft --json`` gives, for every row, the ids of
``tokenizer.apply_chat_template(messages)`` and a loss mask equal to TRL's ``assistant_only_loss`` mask (re-derived
here from the template's ``{% generation %}`` markers with ``return_assistant_tokens_mask``; TRL is not
installed); dpo/rm pairs and grpo prompts render the same way; string rows get BOS as the tokenizer adds it and EOS
closing the completion; ``data.chat_template`` none/PATH and its errors; summary.json names the template used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from chat_tokenizer import CONVERSATIONS, EOS, EOT, LLAMA3_TEMPLATE_MARKED, build_tokenizer, write_jsonl
from in_process import crosstrain_main
from one_line import one_line_error

pytest.importorskip("transformers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
ROWS = [*CONVERSATIONS, dict(CONVERSATIONS[0], tools=TOOLS)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("llama3tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _sets(tok_dir: Path, path: Path, *more: str) -> list[str]:
    # data.val_path = the same rows: every row is a training row, shown in file order
    out = []
    for s in (
        f"data.tokenizer={tok_dir}",
        f"data.path={path}",
        f"data.val_path={path}",
        "model.vocab_size=512",
        "rlhf.max_length=256",
        "rlhf.max_prompt_length=200",
        "model.max_seq_len=256",
        *more,
    ):
        out += ["--set", s]
    return out


def _show(capsys, recipe: str, sets: list[str], rows: int = 10) -> dict:
    capsys.readouterr()
    assert crosstrain_main(["data", "show", "--recipe", recipe, *sets, "--rows", str(rows), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _trl_mask(hf_tok, row: dict) -> tuple[list[int], list[int]]:
    """Ids and assistant mask as TRL's assistant_only_loss computes them: transformers' generation-marker mask."""
    out = hf_tok.apply_chat_template(
        row["messages"],
        tools=row.get("tools"),
        chat_template=LLAMA3_TEMPLATE_MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_data_show_sft_is_apply_chat_template_with_the_assistant_only_mask(tok_dir, hf_tok, tmp_path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    cmd = [
        sys.executable,
        "-m",
        "crosstrain",
        "data",
        "show",
        "--recipe",
        "sft",
        *_sets(tok_dir, path),
        "--rows",
        str(len(ROWS)),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["chat_template"] == "tokenizer" and len(doc["rows"]) == len(ROWS)
    eot = hf_tok.convert_tokens_to_ids(EOT)
    for row, shown in zip(ROWS, doc["rows"], strict=True):
        ids = hf_tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True, return_dict=True)
        assert shown["input_ids"] == list(ids["input_ids"])
        trl_ids, trl_mask = _trl_mask(hf_tok, row)
        assert trl_ids == shown["input_ids"] and shown["loss_mask"] == trl_mask
        # every assistant turn is closed by <|eot_id|> inside the loss: the model learns to stop
        n_assistant = sum(m["role"] == "assistant" for m in row["messages"])
        trained = [t for t, m in zip(shown["input_ids"], shown["loss_mask"], strict=True) if m]
        assert trained.count(eot) == n_assistant and trained[-1] == eot
        assert shown["input_ids"][0] == hf_tok.bos_token_id and shown["input_ids"].count(hf_tok.bos_token_id) == 1


def test_a_template_file_and_none(tok_dir, hf_tok, tmp_path, capsys) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS[:2])
    template = tmp_path / "marked.jinja"
    template.write_text(LLAMA3_TEMPLATE_MARKED)  # same text as the tokenizer's, so the same ids and mask
    own = _show(capsys, "sft", _sets(tok_dir, path))
    marked = _show(capsys, "sft", _sets(tok_dir, path, f"data.chat_template={template}"))
    assert marked["chat_template"] == str(template.resolve()) and marked["rows"] == own["rows"]
    # a template that renders the row's tools: the ids are transformers' with tools=, the tools text is no loss token
    tooled = tmp_path / "tools.jinja"
    tooled.write_text(
        "{% if tools %}{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\nTools: "
        "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}<|eot_id|>"
        "{% set bos_token = '' %}{% endif %}" + LLAMA3_TEMPLATE_MARKED
    )
    row = ROWS[-1]
    got = _show(
        capsys, "sft", _sets(tok_dir, write_jsonl(tmp_path / "tools.jsonl", [row]), f"data.chat_template={tooled}")
    )
    ids = hf_tok.apply_chat_template(
        row["messages"], tools=row["tools"], chat_template=tooled.read_text(), tokenize=True, return_dict=True
    )
    shown = got["rows"][0]
    assert shown["input_ids"] == list(ids["input_ids"]) and "Tools: add<|eot_id|>" in shown["text"]
    assert shown["trained_text"] == "Paris." + EOT
    # none: crosstrain's <|role|> format, trained on the last message, BOS from the tokenizer, EOS appended
    plain = _show(capsys, "sft", _sets(tok_dir, path, "data.chat_template=none"))
    assert plain["chat_template"] == "crosstrain"
    first = plain["rows"][0]
    prompt = "<|user|>\nWhat is the capital of France?\n<|assistant|>\n"
    assert first["input_ids"] == hf_tok(prompt + "Paris.\n" + EOS)["input_ids"]
    assert first["trained_text"] == "Paris.\n" + EOS


def test_string_rows_get_bos_as_the_tokenizer_adds_it_and_eos(tok_dir, hf_tok, tmp_path, capsys) -> None:
    rows = [
        {"prompt": "Question: two plus two?\nAnswer:", "completion": " four"},
        {"prompt": "Say yes.", "completion": " yes" + EOS},
    ]  # already closed: no second EOS
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    doc = _show(capsys, "sft", _sets(tok_dir, path))
    for row, shown in zip(rows, doc["rows"], strict=True):
        text = row["prompt"] + row["completion"]
        text += "" if text.endswith(EOS) else EOS
        # TRL's prompt-completion tokenisation: tokenizer(prompt + completion + eos), completion tokens trained
        assert shown["input_ids"] == hf_tok(text)["input_ids"]
        n_prompt = len(hf_tok(row["prompt"])["input_ids"])
        assert shown["loss_mask"] == [0] * n_prompt + [1] * (len(shown["input_ids"]) - n_prompt)
        assert shown["input_ids"][-1] == hf_tok.eos_token_id and shown["input_ids"].count(hf_tok.eos_token_id) == 1
    # the byte tokenizer has neither BOS nor EOS: the bytes as before
    doc = _show(capsys, "sft", ["--set", f"data.path={path}", "--set", f"data.val_path={path}"])
    assert bytes(doc["rows"][0]["input_ids"]).decode() == rows[0]["prompt"] + rows[0]["completion"]


def test_preference_pairs_and_rl_prompts_render_with_the_template(tok_dir, hf_tok, tmp_path, capsys) -> None:
    user = [{"role": "user", "content": "Pick a fruit."}]
    pairs = [
        {
            "chosen": [*user, {"role": "assistant", "content": "An apple."}],
            "rejected": [*user, {"role": "assistant", "content": "A rock."}],
        },
        {"prompt": user, "chosen": "A pear.", "rejected": [{"role": "assistant", "content": "Nothing."}]},
    ]
    path = write_jsonl(tmp_path / "prefs.jsonl", pairs)
    prompt_ids = hf_tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = list(prompt_ids["input_ids"])
    for recipe in ("dpo", "rm"):
        doc = _show(capsys, recipe, _sets(tok_dir, path))
        assert doc["chat_template"] == "tokenizer"
        for texts, shown in zip([("An apple.", "A rock."), ("A pear.", "Nothing.")], doc["rows"], strict=True):
            for answer, side in zip(texts, ("chosen", "rejected"), strict=True):
                full = user + [{"role": "assistant", "content": answer}]
                ids = list(hf_tok.apply_chat_template(full, tokenize=True, return_dict=True)["input_ids"])
                got = shown[side]
                # TRL's split: the prompt with its generation prompt, then the completion (closed by <|eot_id|>)
                assert got["input_ids"] == ids and got["input_ids"][: len(prompt_ids)] == prompt_ids
                assert got["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
                assert got["trained_text"] == answer + EOT
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": user}, {"prompt": "Plain text prompt"}])
    doc = _show(capsys, "grpo", _sets(tok_dir, prompts, "rl.max_new_tokens=8", "rl.stop="))
    assert doc["rows"][0]["input_ids"] == prompt_ids
    assert doc["rows"][1]["input_ids"] == hf_tok("Plain text prompt")["input_ids"]  # BOS as the tokenizer adds it


def test_summary_names_the_template_used(tok_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    run = tmp_path / "run"
    sets = [
        "model.n_layers=1",
        "model.dim=32",
        "model.n_heads=2",
        "train.batch_size=2",
        "train.steps=2",
        "eval.every=0",
        "logging.progress=none",
        "backend=cpu",
        "train.seq_len=256",
    ]
    argv = ["train", "--recipe", "sft", "--run-dir", str(run), *_sets(tok_dir, path)]
    for s in sets:
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rlhf_data"]["chat_template"] == "tokenizer" and summary["rlhf_data"]["train_rows"] == len(ROWS)


def _fails(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert crosstrain_main(argv) == 2
    captured = capsys.readouterr()
    return one_line_error(captured.out, captured.err)[-1]


def test_bad_templates_and_recipes_are_one_line(tok_dir, tmp_path, capsys) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS)
    show = ["data", "show", "--recipe", "sft"]
    err = _fails([*show, *_sets(tok_dir, path, f"data.chat_template={tmp_path / 'missing.jinja'}")], capsys)
    assert "is not a file" in err and "data.chat_template" in err
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    err = _fails([*show, "--set", f"data.path={path}", "--set", f"data.chat_template={template}"], capsys)
    assert "needs a Hugging Face tokenizer folder" in err
    # a template that numbers the turns from the end renders a prefix differently from the whole conversation
    template.write_text(
        "{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    err = _fails([*show, *_sets(tok_dir, path, f"data.chat_template={template}")], capsys)
    assert "prefix by prefix" in err
    write_jsonl(path, [{"messages": [{"role": "user", "content": "no answer"}]}])
    err = _fails([*show, *_sets(tok_dir, path)], capsys)
    assert f"{path}:1: no assistant message" in err
    err = _fails(["data", "show", "--recipe", "lm"], capsys)
    assert "data info" in err
    assert "--rows" in _fails([*show, "--rows", "0"], capsys)


def test_spans_mask_tokens_and_truncation_keeps_the_prompt_end() -> None:
    from crosstrain.data.tokenizer import ByteTokenizer
    from crosstrain.plugins.rlhf.data import Rendered, encode_rendered

    tok = ByteTokenizer()
    ids, offsets = tok.encode_offsets("aé")  # a 2-byte character: both bytes belong to character 1
    assert ids.tolist() == [97, 0xC3, 0xA9] and offsets.tolist() == [[0, 1], [1, 2], [1, 2]]
    row = Rendered("abcXYdeZW", spans=((3, 5), (7, 9)), templated=True)  # two trained turns with a gap
    full = encode_rendered(tok, row, 64, 64)
    assert full.loss_mask().astype(int).tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1] and full.prompt_len == 3
    cut = encode_rendered(tok, row, 6, 2)  # the prompt keeps its last 2 tokens, the rest its first 4
    assert bytes(cut.ids.astype("uint8")) == b"bcXYde" and cut.truncated
    assert cut.loss_mask().astype(int).tolist() == [0, 0, 1, 1, 0, 0] and cut.prompt_len == 2


def test_data_show_prints_text_trained_tokens_and_mask(tok_dir, tmp_path, capsys) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", ROWS[:1])
    capsys.readouterr()
    assert crosstrain_main(["data", "show", "--recipe", "sft", *_sets(tok_dir, path), "--rows", "1"]) == 0
    out = capsys.readouterr().out
    shown = _show(capsys, "sft", _sets(tok_dir, path), rows=1)["rows"][0]
    n, trained = len(shown["input_ids"]), sum(shown["loss_mask"])
    assert "chat template tokenizer" in out and f"--- row 0: {n} tokens, {trained} in the loss" in out
    assert "--- in the loss: 'Paris.<|eot_id|>'" in out
    assert "--- loss_mask: " + "0" * (n - trained) + "1" * trained in out
