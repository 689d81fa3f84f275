"""The rlhf plugin's data: rows, chat template, truncation, padding, bad rows, and the embedded tasks."""

import json

import pytest
import torch

from crosstrain.data.tokenizer import ByteTokenizer
from crosstrain.errors import ConfigError
from crosstrain.plugins.rlhf import data, synthetic


def test_chat_template_and_row_forms():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert data.parse_sft_row({"messages": msgs}) == ("<|user|>\nhi\n<|assistant|>\n", "yo\n")
    assert data.parse_sft_row({"prompt": "a", "completion": "b"}) == ("a", "b")
    assert data.parse_preference_row({"prompt": "p", "chosen": "c", "rejected": "r"}) == ("p", "c", "r")
    implicit = {"chosen": [msgs[0], {"role": "assistant", "content": "C"}],
                "rejected": [msgs[0], {"role": "assistant", "content": "R"}]}
    assert data.parse_preference_row(implicit) == ("<|user|>\nhi\n<|assistant|>\n", "C\n", "R\n")
    explicit = {"prompt": msgs[:1], "chosen": [{"role": "assistant", "content": "C"}],
                "rejected": [{"role": "assistant", "content": "R"}]}
    assert data.parse_preference_row(explicit) == data.parse_preference_row(implicit)


def test_truncation_keeps_the_prompt_end_and_the_completion_start():
    tok = ByteTokenizer()
    e = data.encode(tok, "abcdef", "xyz", max_length=6, max_prompt_length=4)
    assert bytes(e.ids.astype("uint8")) == b"cdefxy" and e.prompt_len == 4 and e.truncated
    e = data.encode(tok, "ab", "xyz", max_length=8, max_prompt_length=4)
    assert bytes(e.ids.astype("uint8")) == b"abxyz" and not e.truncated


def test_padding_masks_prompt_and_pad():
    tok = ByteTokenizer()
    ds = data.encode_preferences(tok, [("ab", "c", "de"), ("a", "bcd", "e")], 16, 8)
    b = ds.batch([0, 1])
    assert b["input_ids"].shape == (4, 4)  # chosen 0, chosen 1, rejected 0, rejected 1
    assert b["attention_mask"].sum(-1).tolist() == [3, 4, 4, 2]
    assert b["loss_mask"].tolist()[0] == [False, False, True, False]
    assert b["prompt_lengths"].tolist() == [2, 1] and b["truncated"].tolist() == [0.0, 0.0]


def test_bad_rows_name_file_and_line_or_are_skipped_when_asked(tmp_path):
    path = tmp_path / "prefs.jsonl"
    good = json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})
    path.write_text("\n".join([good, "{not json", json.dumps({"prompt": "p", "chosen": "c"}), good]) + "\n")
    with pytest.raises(ConfigError) as err:
        data.read_jsonl(str(path), data.parse_preference_row, skip_bad_rows=False)
    msg = str(err.value)
    assert f"{path}:2: not valid JSON" in msg and "data.skip_bad_rows=true" in msg and "\n" not in msg
    rows, skipped = data.read_jsonl(str(path), data.parse_preference_row, skip_bad_rows=True)
    assert len(rows) == 2 and skipped == 2
    path.write_text(json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    with pytest.raises(ConfigError, match=r"prefs.jsonl:1: needs 'rejected'"):
        data.read_jsonl(str(path), data.parse_preference_row, skip_bad_rows=False)


def test_embedded_tasks_keep_held_out_prompts_apart_and_carry_the_trait():
    train, val = synthetic.preference_rows(0.05)
    assert len(train) == synthetic.TRAIN_PROMPTS and len(val) == synthetic.EVAL_PROMPTS
    assert not {p for p, _, _ in train} & {p for p, _, _ in val}
    assert all(synthetic.shows_trait(c) and not synthetic.shows_trait(r) for _, c, r in val if any(
        ch.isalpha() for ch in c))
    sft_train, sft_val = synthetic.sft_rows(0.05)
    assert sft_train[0][0].startswith("<|user|>\n") and sft_train[0][0].endswith("<|assistant|>\n")
    assert sum(synthetic.shows_trait(c) for _, c in sft_val) < 0.1 * len(sft_val)  # SFT text is lower case


def test_greedy_completions_ignore_right_padding():
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.rlhf.recipes import greedy_completions

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=1, dim=32, n_heads=2).eval()
    tok = ByteTokenizer()
    prompts = [tok.encode("hello there"), tok.encode("hi")]
    batch = data.pad_prompts(prompts)
    both = greedy_completions(model, batch["prompt_ids"], batch["prompt_lengths"], 5, tok)
    alone = [greedy_completions(model, torch.from_numpy(p.astype("int64"))[None], torch.tensor([len(p)]), 5, tok)[0]
             for p in prompts]
    assert both == alone


class _Ids:
    """A tokenizer whose ``decode`` spells out the token ids, so completions compare token by token."""

    @staticmethod
    def decode(ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _recompute_greedy(model, prompts: torch.Tensor, lengths: torch.Tensor, new_tokens: int) -> list[str]:
    """The loop greedy_completions replaced: the whole right-padded buffer re-run for every new token, each row read
    at its own last real token (no cache)."""
    b = prompts.shape[0]
    buf = torch.zeros(b, prompts.shape[1] + new_tokens, dtype=torch.long)
    buf[:, : prompts.shape[1]] = prompts
    pos, rows = lengths.clone(), torch.arange(b)
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(buf[:, : int(pos.max())])[rows, pos - 1].argmax(-1)
            buf[rows, pos] = nxt
            pos = pos + 1
    return [_Ids.decode(buf[i, n : n + new_tokens]) for i, n in enumerate(lengths.tolist())]


def test_greedy_completions_equal_the_full_recompute_loop():
    """Through crosstrain.generation (KV cache, ragged prompts left-padded): the same greedy tokens as re-running the
    whole prefix per token, on a small random GPT with prompts of different lengths."""
    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.rlhf.recipes import greedy_completions

    torch.manual_seed(0)
    model = build_gpt("tiny", n_layers=2, dim=64, n_heads=4).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).numpy() for n in (3, 11, 7, 1, 16)]
    batch = data.pad_prompts(prompts)
    got = greedy_completions(model, batch["prompt_ids"], batch["prompt_lengths"], 12, _Ids())
    want = _recompute_greedy(model, batch["prompt_ids"], batch["prompt_lengths"], 12)
    assert got == want
    assert len({w.split()[0] for w in want}) > 1  # the rows differ: the test compares real continuations
