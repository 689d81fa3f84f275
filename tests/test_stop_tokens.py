"""Stop tokens everywhere generation runs (issue 38): one stop set (crosstrain.generation.stops) from a Llama-3-style
tokenizer folder (EOS, the chat template's <|eot_id|>, generation_config.json's eos_token_id list), used by
`crosstrain generate`, GRPO/PPO rollouts and on-policy distillation; with a tiny model whose stop tokens are
sampled often, no loss-mask token follows a row's first stop token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crosstrain.config import load_config
from crosstrain.generation.stops import stop_tokens
from crosstrain.models.gpt import GPT, GPTConfig

pytest.importorskip("tokenizers")

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
WORDS = ["a", "b", "c", "d", "e", "f", "g", "[UNK]"]
EOS, EOT, EXTRA = 1, 2, 9  # <|end_of_text|>, <|eot_id|>, "f" (listed in generation_config.json only)
TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
            "<|eot_id|>{% endfor %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    out = tmp_path_factory.mktemp("llama3ish")
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
                                                           "chat_template": TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, EXTRA]}))
    words = WORDS[:-1]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": " ".join(words[(i + j) % 7] for j in range(4))})
                                               + "\n" for i in range(12)))
    return out


def _tiny(vocab: int = 16) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, dim=32, n_layers=1, n_heads=2, max_seq_len=64)).eval()


def _after_first_stop(tokens: torch.Tensor, mask: torch.Tensor, stops: tuple[int, ...]) -> tuple[int, int]:
    """(mask tokens after each row's first stop token, rows that hold a stop token before their last slot)."""
    after = early = 0
    for row, m in zip(tokens.tolist(), mask.tolist(), strict=True):
        first = next((i for i, t in enumerate(row) if t in stops and m[i]), None)
        if first is not None:
            after += sum(m[first + 1:])
            early += first < len(row) - 1
    return after, early


def test_stop_set_from_eos_template_and_generation_config(folder, tmp_path) -> None:
    assert stop_tokens(str(folder)) == (EOS, EOT, EXTRA)
    assert stop_tokens("") == () and stop_tokens("byte", extra=(10,)) == (10,)
    # no chat template: <|eot_id|> is not an end of turn; a model folder's generation_config.json (an int) joins
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        doc = json.loads((folder / name).read_text())
        doc.pop("chat_template", None)
        (bare / name).write_text(json.dumps(doc))
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_tokens(str(bare)) == (EOS,) and stop_tokens(str(bare), model) == (EOS, 7)


def test_on_policy_distillation_masks_nothing_after_a_stop(folder) -> None:
    from crosstrain.plugins.compress.distill.data import DistillBatch
    from crosstrain.plugins.compress.distill.onpolicy import sample_completions
    from crosstrain.plugins.compress.distill.recipe import DistillRecipe

    config = load_config(None, [f"data.tokenizer={folder}", f"data.path={folder / 'prompts.jsonl'}"])
    stops = DistillRecipe().stop_set(config)
    assert stops == (EOS, EOT, EXTRA)
    rows, width, prompt = 16, 24, 3
    inputs = torch.randint(3, 16, (rows, width), generator=torch.Generator().manual_seed(1))
    batch = DistillBatch(inputs=inputs, targets=inputs.roll(-1, 1), mask=torch.ones(rows, width, dtype=torch.bool),
                         prompt_lengths=torch.full((rows,), prompt), index=torch.arange(rows))
    out = sample_completions(_tiny(), batch, temperature=1.0, max_seq_len=64, stop_tokens=stops,
                             generator=torch.Generator().manual_seed(2))
    after, early = _after_first_stop(out.targets, out.mask, stops)
    assert early >= rows // 2  # the stop set is sampled often: most rows stop before the end
    assert after == 0
    # the same draw without the stop set keeps sampling after the stop (what the mask held before issue 38)
    free = sample_completions(_tiny(), batch, temperature=1.0, max_seq_len=64,
                              generator=torch.Generator().manual_seed(2))
    assert _after_first_stop(free.targets, free.mask, stops)[0] > 0


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_rl_rollouts_mask_nothing_after_a_stop(folder, recipe) -> None:
    from crosstrain.plugins.rlhf.rl.grpo import GRPORecipe
    from crosstrain.plugins.rlhf.rl.ppo import PPORecipe
    from crosstrain.plugins.rlhf.rl.rollout import prompt_noise, sample

    config = load_config(None, [f"data.tokenizer={folder}", f"data.path={folder / 'prompts.jsonl'}",
                                "model.vocab_size=16", "model.max_seq_len=64", "train.seq_len=64",
                                "rl.max_new_tokens=16", "rl.stop="])
    rl = (GRPORecipe if recipe == "grpo" else PPORecipe)()
    rl.validate(config)
    assert rl.stop_tokens == (EOS, EOT, EXTRA)
    rl.configure(config, 0, 1, 1)
    assert rl.gen_config.stop_tokens == rl.stop_tokens
    prompts = (rl.prompts["train"] * 2)[:8]
    noise = prompt_noise(123, list(range(8)), 2, rl.gen_config.max_new_tokens)
    packed = sample(_tiny(), prompts, 2, rl.gen_config, noise, rl.width)
    after, early = _after_first_stop(packed.tokens, packed.mask, rl.stop_tokens)
    assert early >= 8 and after == 0
    assert bool(packed.stopped.any())


def test_crosstrain_generate_stops_at_every_stop_token(folder) -> None:
    from crosstrain.data.hf_tokenizer import describe_tokenizer
    from crosstrain.plugins.export.generate import Sampling, TorchEngine, generate

    engine = TorchEngine(_tiny(), describe_tokenizer(str(folder)))
    rows = generate(engine, [[3, 4, 5]] * 16, 24, Sampling(temperature=1.0, seed=3),
                    eos_id=engine.tokenizer["eos_id"])
    stops = (EOS, EOT, EXTRA)
    assert all(t not in stops for row in rows for t in row[:-1])  # nothing generated after a stop
    assert {row[-1] for row in rows if len(row) < 24} >= {EOT, EXTRA}  # not only the tokenizer's eos_id ends a row


def test_the_cache_feeding_loop_stops_at_the_same_tokens(folder) -> None:
    """The onnxruntime engine's loop (``_ort_loop``, run here on the torch engine's concatenating cache, the layout
    the exported graph computes) cuts rows at the same stop set and gives the torch engine's tokens."""
    import numpy as np

    from crosstrain.data.hf_tokenizer import describe_tokenizer
    from crosstrain.plugins.export.generate import Sampling, TorchEngine, _ort_loop, generate, stop_set

    engine = TorchEngine(_tiny(), describe_tokenizer(str(folder)))
    stops = stop_set(engine.tokenizer, engine.tokenizer["eos_id"])
    assert stops == (EOS, EOT, EXTRA)
    sampling = Sampling(temperature=1.0, seed=3)
    ref = generate(engine, [[3, 4, 5]] * 16, 24, sampling, eos_id=EOS)
    rows = _ort_loop(engine, np.asarray([[3, 4, 5]] * 16), 24, sampling, stops, torch.Generator().manual_seed(3))
    assert rows == ref and any(len(r) < 24 for r in rows)
