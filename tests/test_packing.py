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
    inputs, targets, doc = ds.batch([0, 1, 3])
    assert inputs.shape == doc.shape == (3, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert doc[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert doc[1].tolist() == [0, 0, 0, 0, 1, 2, 2, 2]  # tokens 8..15: doc 1 until 11, doc 2 at 12, doc 3 from 13
    assert doc[2].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]


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
        LMRecipe().validate(load_config(None, ["data.packing=documents", f"data.path={bare}"]))
