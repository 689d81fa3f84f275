"""Sliding-window and packed-document attention without a dense mask, against dense-mask SDPA.

The reference everywhere is ``scaled_dot_product_attention`` with the ``[B, 1, T, T]`` boolean mask
(:meth:`AttentionMask.dense`, built from the rule ``j <= i``, ``i - j < window``, same document); the chunked path
must match it forward and backward, the FlexAttention mask/score mods forward (its CPU backward is unsupported by
torch), and the GPT must keep its windows through packing, the KV cache and training.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from crosstrain.models.attention_masks import AttentionMask, attention, attention_backend, softcap_scores
from crosstrain.models.document_mask import segment_index
from crosstrain.models.gpt import GPT, GPTConfig


def _docs(t: int, lengths: list[int]) -> torch.Tensor:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    assert ids.numel() == t
    return ids


# (T, window, document lengths per row or None, chunk): T not a multiple of the chunk, windows wider than T,
# documents shorter and longer than the window, a chunk boundary inside a document
LAYOUTS = [
    (37, 8, None, 8),
    (37, 0, [[10, 20, 7], [1, 30, 6]], 16),
    (50, 12, [[5, 30, 15], [50]], 16),
    (29, 5, [[3, 3, 23], [29]], 7),
    (20, 64, None, 8),
]


def _reference(q, k, v, mask: AttentionMask, scale: float, softcap: float) -> torch.Tensor:
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    dense = mask.dense(q.device)
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    scores = softcap_scores(q @ k.transpose(-2, -1) * scale, softcap).masked_fill(~dense, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize(("t", "window", "docs", "chunk"), LAYOUTS)
def test_chunked_equals_dense_mask_forward_and_backward(t, window, docs, chunk, softcap) -> None:
    g = torch.Generator().manual_seed(t + window)
    segments = None if docs is None else segment_index(torch.stack([_docs(t, row) for row in docs]))
    batch = 2
    q = torch.randn(batch, 4, t, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(batch, 2, t, 8, generator=g, requires_grad=True) for _ in range(2))  # grouped-query
    mask = AttentionMask(t, window, segments, chunk=chunk)
    assert attention_backend(q.device) == "chunked"  # CPU: FlexAttention has no backward here
    out = attention(q, k, v, mask, scale=0.3, softcap=softcap)
    ref = _reference(q, k, v, mask, 0.3, softcap)
    grad = torch.randn(out.shape, generator=g)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the chunks never hold more than chunk x (chunk + window - 1) keys when there is a window
    widths = [m.shape[-1] for _, _, _, m in mask.chunks(q.device)]
    assert sum(e - s for s, e, _, _ in mask.chunks(q.device)) == t
    if window and docs is None:
        assert max(widths) <= chunk + window - 1


def test_flex_attention_mask_and_score_mods_equal_dense() -> None:
    """The block mask and soft-cap score_mod FlexAttention uses on CUDA, run by its eager CPU path (forward)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from crosstrain.models.attention_masks import flex_attention

    g = torch.Generator().manual_seed(3)
    t = 150  # more than one 128-block, not a multiple of it
    segments = segment_index(torch.stack([_docs(t, [40, 110]), _docs(t, [150])]))
    q, k, v = (torch.randn(2, 2, t, 8, generator=g) for _ in range(3))
    mask = AttentionMask(t, 24, segments)  # one mask: each block mask costs seconds to build on CPU
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # "called without torch.compile": the unfused reference path
        out = flex_attention(q, k, v, mask, scale=0.25, softcap=4.0, compiled=False)
    torch.testing.assert_close(out, _reference(q, k, v, mask, 0.25, 4.0), atol=1e-5, rtol=0)


CFG = GPTConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64,
                layer_windows=(6, 0, 6))


def test_window_at_least_the_sequence_is_plain_causal_sdpa() -> None:
    """A window >= T (Mistral's 4096 on short rows) takes SDPA is_causal: bit-identical to no window."""
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64)).eval()
    windowed = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64, sliding_window=40))
    windowed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 64, (2, 40))
    assert torch.equal(windowed.eval()(tokens), plain(tokens))
    assert not torch.equal(windowed(torch.randint(0, 64, (2, 41))), plain(torch.randint(0, 64, (2, 41))))


def test_packed_documents_with_a_window_equal_each_document_alone() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    lengths = [9, 20, 11]
    tokens = torch.randint(0, 64, (1, sum(lengths)))
    with torch.no_grad():
        packed = model(tokens, doc_ids=_docs(sum(lengths), lengths)[None])
        start = 0
        for n in lengths:
            alone = model(tokens[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, atol=1e-5, rtol=0)
            start += n


def test_kv_cache_decoding_respects_the_window() -> None:
    """Prefill + one token at a time through the static cache (and the concatenating one) gives the full
    forward's logits well past the window."""
    from crosstrain.generation import StaticKVCache

    torch.manual_seed(0)
    model = GPT(CFG).eval()
    tokens = torch.randint(0, 64, (2, 30))
    with torch.no_grad():
        full = model(tokens)
        cache = StaticKVCache(CFG.n_layers, 2, 30)
        steps = [model.forward_cached(tokens[:, :5], torch.arange(5).expand(2, 5), cache, None)]
        past = None
        concat = []
        for i in range(5, 30):
            steps.append(model.forward_cached(tokens[:, i:i + 1], torch.full((2, 1), i), cache, None))
        for i in range(30):
            logits, past = model.forward_with_cache(tokens[:, i:i + 1], past)
            concat.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(concat, dim=1), full, atol=1e-5, rtol=0)


def test_training_with_a_window_and_packed_documents_lowers_the_loss(tmp_path) -> None:
    """``model.sliding_window`` on the tiny preset with ``data.packing=documents``: backward runs through the
    chunked attention and the loss falls."""
    import json

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    run = tmp_path / "run"
    overrides = ["logging.progress=none", "train.steps=12", "train.seq_len=64", "train.batch_size=4",
                 "model.sliding_window=16", "data.packing=documents", "eval.every=0", "checkpoint.every=0",
                 "schedule.warmup_steps=2"]
    Trainer(load_config(None, overrides), run_dir=run).fit()
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses[-1] < losses[0] - 0.5
    # exported as a Mistral with the same window: transformers gives the same logits past the window
    transformers = pytest.importorskip("transformers")
    from crosstrain.cli.main import main
    from crosstrain.plugins.export.loading import load_model

    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["sliding_window"]) == ("mistral", 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 50))
    with torch.no_grad():
        torch.testing.assert_close(load_model(run).model(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


def test_torch_compile_traces_windowed_and_packed_attention() -> None:
    """``parallel.compile`` wraps the GPT in torch.compile: the chunked path (an autograd.Function) must trace, and
    give eager's logits and gradients."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64, sliding_window=8))
    tokens = torch.randint(0, 64, (2, 40))
    doc_ids = (torch.arange(40) >= 17).long().expand(2, -1)
    results = []
    for fn in (model, torch.compile(model, backend="aot_eager")):  # one compile: window and documents together
        model.zero_grad()
        logits = fn(tokens, doc_ids=doc_ids)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
