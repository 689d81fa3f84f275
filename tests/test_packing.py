"""Packing with document-aware attention: block-causal masks, per-document positions, packed == alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crosstrain.kernels import registry
from crosstrain.models.document_mask import block_causal_mask, document_positions, segment_index
from crosstrain.models.gpt import build_gpt


def test_positions_and_mask_closed_form() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 0], list(range(6))]
    assert segment_index(doc).tolist() == [[0, 0, 0, 1, 1, 2], [0] * 6]
    mask = block_causal_mask(doc)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 6)):
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(mask[0], expected)
    assert torch.equal(mask[1], torch.ones(6, 6, dtype=torch.bool).tril())


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2, "qkv_bias": True}])
def test_packed_documents_get_the_logits_they_get_alone(overrides: dict) -> None:
    torch.manual_seed(0)
    model = build_gpt("tiny", **overrides).eval()
    if overrides.get("qkv_bias"):
        with torch.no_grad():
            for block in model.blocks():
                block.attention.wq.bias.normal_(0, 0.5)
                block.attention.wk.bias.normal_(0, 0.5)
    lengths = [[5, 17, 1, 9], [32]]
    gen = torch.Generator().manual_seed(1)
    rows = [[torch.randint(0, 256, (n,), generator=gen) for n in row] for row in lengths]
    tokens = torch.stack([torch.cat(r) for r in rows])
    doc_ids = torch.stack([torch.cat([torch.full((len(d),), i) for i, d in enumerate(r)]) for r in rows])
    with torch.no_grad(), registry.use_reference():
        packed = model(tokens, doc_ids=doc_ids)
        for b, row in enumerate(rows):
            start = 0
            for doc in row:
                alone = model(doc.unsqueeze(0))[0]
                assert torch.allclose(packed[b, start:start + len(doc)], alone, atol=1e-5, rtol=0)
                start += len(doc)
        # one document per row: the same as the default causal path
        assert torch.allclose(model(tokens, doc_ids=torch.zeros_like(tokens)), model(tokens), atol=1e-5, rtol=0)


def test_packed_dataset_numbers_documents_per_row() -> None:
    from crosstrain.data.dataset import TokenDataset
    from crosstrain.data.packing import PackedDataset

    ds = PackedDataset(TokenDataset(np.arange(41, dtype=np.int64), 8), np.array([0, 3, 12, 13, 30]))
    b = ds.batch([0, 1, 3])
    inputs, targets, doc = b.inputs, b.targets, b.document_ids
    assert inputs.shape == doc.shape == (3, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert doc[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert doc[1].tolist() == [0, 0, 0, 0, 1, 2, 2, 2]  # tokens 8..15: doc 1 until 11, doc 2 at 12, doc 3 from 13
    assert doc[2].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert b.positions[1].tolist() == [0, 1, 2, 3, 0, 0, 1, 2]  # 0 at each row and document start


def test_training_with_packing_runs_and_needs_boundaries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from crosstrain.config import load_config
    from crosstrain.data.tokenfile import write_token_file
    from crosstrain.engine import Trainer
    from crosstrain.errors import ConfigError
    from crosstrain.recipes.lm import LMRecipe

    summary = Trainer(load_config(None, ["data.packing=documents", "logging.progress=none", "train.steps=3",
                                         "train.seq_len=32", "train.batch_size=4", "eval.every=0"]),
                      run_dir=tmp_path / "run").fit()
    assert summary["final_loss"] < summary["initial_loss"]
    bare = tmp_path / "bare.bin"  # a token file without a manifest: no document boundaries
    write_token_file(bare, [np.arange(2000) % 256], 256)
    with pytest.raises(ConfigError, match="needs document boundaries"):
        LMRecipe().validate(load_config(None, ["data.packing=documents", f"data.path={bare}", "data.val_fraction=0"]))


def test_token_batch_cannot_lose_a_field_and_reaches_the_model_whole() -> None:
    """Unpacking or indexing a batch is a TypeError naming the fields (a 3-tuple unpacked as 2 or sliced used
    to drop the document ids silently); ``to_device`` moves every field; the lm loss masks by document."""
    from crosstrain.data.dataset import TokenDataset
    from crosstrain.data.packing import PackedDataset
    from crosstrain.engine.step import to_device
    from crosstrain.recipes.lm import LMRecipe, next_token_loss

    ds = PackedDataset(TokenDataset(np.arange(200, dtype=np.int64) % 64, 16), np.array([0, 5, 40, 41, 90]))
    batch = ds.batch([0, 2, 5])
    for lossy in (lambda b: tuple(b), lambda b: b[:2], lambda b: b[0]):
        with pytest.raises(TypeError, match=r"not a tuple: read batch\.inputs, batch\.targets .*batch\.document_ids"):
            lossy(batch)
    with pytest.raises(TypeError, match="not a tuple"):
        _inputs, _targets = batch  # what docs/recipes.md once showed
    moved = to_device(batch, torch.device("meta"))
    assert type(moved) is type(batch) and {t.device.type for t in (moved.inputs, moved.targets, moved.document_ids,
                                                                   moved.positions)} == {"meta"}
    assert to_device(TokenDataset(np.arange(40), 8).batch([0]), torch.device("meta")).document_ids is None

    model = build_gpt("tiny", vocab_size=64, n_layers=1, dim=32, n_heads=2, max_seq_len=16).eval()
    with torch.no_grad(), registry.use_reference():
        got = LMRecipe().loss({"model": model}, batch).loss
        masked = next_token_loss(model(batch.inputs, doc_ids=batch.document_ids), batch.targets)
        unmasked = next_token_loss(model(batch.inputs), batch.targets)
    assert torch.equal(got, masked) and not torch.equal(got, unmasked)
