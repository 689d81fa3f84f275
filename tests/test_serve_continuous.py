"""Continuous batching in crosstrain.generation (the serve plugin's decode loop) and the serving gate: sequences
that join and leave a running batch decode exactly what they decode alone with ``generate``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from crosstrain.generation import ContinuousBatch, GenerationConfig, Sequence, SlotKVCache, generate
from crosstrain.models.gpt import build_gpt


@pytest.fixture(scope="module")
def model() -> Iterator[torch.nn.Module]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's ops are too small to split; threads would only wait on each other
    torch.manual_seed(0)
    m = build_gpt("tiny", n_layers=2, n_kv_heads=2, max_seq_len=64)  # grouped-query attention too
    m.init_weights()
    yield m.eval()
    torch.set_num_threads(threads)


def _run(model: torch.nn.Module, seqs: list[Sequence], slots: int) -> int:
    """Join one sequence every other step (so rows of different lengths share steps); the most rows seen live."""
    batch, pending, step, most = ContinuousBatch(model, slots), list(seqs), 0, 0
    while pending or batch.live:
        if pending and batch.free and step % 2 == 0:
            batch.add(pending.pop(0))
        most = max(most, len(batch.live))
        batch.step()
        step += 1
    return most


def test_joining_sequences_decode_what_they_decode_alone(model: torch.nn.Module) -> None:
    """Greedy, and seeded sampling with top-k/top-p, with a stop token: tokens equal ``generate`` on the prompt alone
    (the same seed), log-probs within 1e-5, while up to 3 others of other lengths share the steps."""
    lengths, news = (5, 9, 2, 17, 4, 11, 3), (7, 12, 3, 20, 1, 9, 15)
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate(lengths)]
    configs = [GenerationConfig(max_new_tokens=n, greedy=i % 2 == 0, temperature=0.9, top_k=40 if i % 3 else 0,
                                top_p=0.9, stop_tokens=(17,) if i == 5 else ()) for i, n in enumerate(news)]
    alone = [generate(model, [p], c, torch.Generator().manual_seed(i)) for i, (p, c) in
             enumerate(zip(prompts, configs, strict=True))]
    seqs = [Sequence(p, c, torch.Generator().manual_seed(i)) for i, (p, c) in
            enumerate(zip(prompts, configs, strict=True))]
    assert _run(model, seqs, slots=4) == 4
    for seq, ref in zip(seqs, alone, strict=True):
        n = int(ref.lengths[0])
        assert seq.done and seq.tokens == ref.tokens[0, :n].tolist()
        assert max(abs(a - b) for a, b in zip(seq.logprobs, ref.logprobs[0, :n].tolist(), strict=True)) < 1e-5


def test_slot_cache_release_keeps_rows_packed(model: torch.nn.Module) -> None:
    """Dropping a middle sequence moves the last one into its row; both keep decoding their own tokens."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    cfg = GenerationConfig(max_new_tokens=6, greedy=True)
    batch = ContinuousBatch(model, 3)
    seqs = [batch.add(Sequence(p, cfg)) for p in prompts]
    batch.step()
    batch.drop(seqs[0])
    assert [s.row for s in batch.live] == [0, 1] and batch.live[0] is seqs[2] and batch.cache.rows == 2
    while batch.live:
        batch.step()
    for seq, prompt in zip(seqs[1:], prompts[1:], strict=True):
        assert seq.tokens == generate(model, [prompt], cfg).tokens[0].tolist()


def test_refusals_are_one_line(model: torch.nn.Module) -> None:
    from one_line import raises_one_line

    from crosstrain.errors import ConfigError

    batch = ContinuousBatch(model, 1)
    raises_one_line(lambda: batch.add(Sequence(list(range(60)), GenerationConfig(max_new_tokens=8))),
                    "exceeds the model's context of 64")
    raises_one_line(lambda: batch.add(Sequence([], GenerationConfig())), "at least one token")
    raises_one_line(lambda: batch.add(Sequence([300], GenerationConfig())), "[0, 256)")
    with pytest.raises(ConfigError):
        ContinuousBatch(model, 0)
    with pytest.raises(ValueError, match="one token per row"):
        SlotKVCache(2, 1, 8).attention_mask(None, 2)


def test_gate_refuses_nan_weights_and_nan_eval_loss(model: torch.nn.Module, tmp_path: object) -> None:
    from pathlib import Path

    from crosstrain.plugins.serve.gate import check

    run = Path(str(tmp_path))
    (run / "metrics.jsonl").write_text('{"step": 3, "eval/loss": 2.5}\n{"step": 5, "eval/loss": NaN}\n')
    ok = check(model, None, run, 3)
    assert ok.passed and ok.eval_loss == 2.5 and ok.max_abs_err is not None and ok.max_abs_err < 1e-4
    bad_loss = check(model, None, run, 5)
    assert not bad_loss.passed and bad_loss.eval_loss is not None and math.isnan(bad_loss.eval_loss)
    poisoned = build_gpt("tiny", n_layers=2, n_kv_heads=2, max_seq_len=64)
    poisoned.load_state_dict(model.state_dict())
    with torch.no_grad():
        poisoned.layers["0"].attention.wq.weight[0, 0] = float("nan")
    report = check(poisoned.eval(), None, None, None)
    assert not report.passed and "not finite" in report.reason


def test_a_sliding_window_model_decodes_what_it_decodes_alone() -> None:
    """Per-layer windows (one local, one global layer, Gemma's layout) shorter than the sequences: each row's slot
    mask hides the keys its window left behind, so batched greedy tokens equal ``generate`` alone."""
    torch.manual_seed(1)
    m = build_gpt("tiny", n_layers=2, max_seq_len=64, layer_windows=(6, 0))
    m.init_weights()
    m.eval()
    prompts = [[(5 * i + 11 * j) % 256 for j in range(n)] for i, n in enumerate((3, 9, 14))]
    config = GenerationConfig(max_new_tokens=12, greedy=True)
    alone = [generate(m, [p], config).tokens[0].tolist() for p in prompts]
    seqs = [Sequence(p, config, None) for p in prompts]
    _run(m, seqs, slots=2)
    assert [s.tokens for s in seqs] == [a[:len(s.tokens)] for s, a in zip(seqs, alone, strict=True)]
    assert all(len(s.tokens) == len(a) for s, a in zip(seqs, alone, strict=True))
