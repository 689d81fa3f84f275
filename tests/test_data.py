"""Data: embedded corpus, byte tokenizer, token files (memory-mapped), `crosstrain data prepare`, sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crosstrain.cli.main import main
from crosstrain.data import ByteTokenizer, DistributedBatchSampler, TokenDataset, build_dataset
from crosstrain.data.corpus import corpus_bytes
from crosstrain.data.generate_corpus import generate
from crosstrain.data.tokenfile import open_token_file, write_token_file
from crosstrain.errors import ConfigError


def test_embedded_corpus_is_shipped_small_and_reproducible() -> None:
    data = corpus_bytes()
    assert 100_000 < len(data) <= 1_000_000
    assert data.decode("ascii") == generate()  # the committed file is exactly what the generator writes
    words = data.split()
    assert len(set(words)) > 100 and data.count(b". ") > 1000


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "Grüße, world! ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    with pytest.raises(ValueError):
        tok.decode([300])


def test_token_file_write_and_memmap(tmp_path) -> None:
    path = tmp_path / "t.bin"
    chunks = [np.arange(0, 300, dtype=np.int64) % 256, np.array([7, 8, 9])]
    assert write_token_file(path, chunks, 256) == 303
    tokens, vocab = open_token_file(path)
    assert isinstance(tokens, np.memmap) and vocab == 256 and tokens.dtype == np.uint8
    assert tokens[:5].tolist() == [0, 1, 2, 3, 4] and tokens[-3:].tolist() == [7, 8, 9]
    wide = tmp_path / "w.bin"
    write_token_file(wide, [np.array([1000, 2, 65000])], 65536)
    tokens, vocab = open_token_file(wide)
    assert tokens.dtype == np.uint16 and tokens.tolist() == [1000, 2, 65000]
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "x.bin", [np.array([256])], 256)
    assert not (tmp_path / "x.bin").exists() and not list(tmp_path.glob(".x.bin*"))
    (tmp_path / "junk.bin").write_bytes(b"not a token file at all, definitely not")
    with pytest.raises(ConfigError, match="not a crosstrain token file"):
        open_token_file(tmp_path / "junk.bin")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="truncated"):
        open_token_file(path)


def test_dataset_windows_are_input_target_shifted() -> None:
    tokens = np.arange(41, dtype=np.uint8)
    ds = TokenDataset(tokens, seq_len=8)
    assert len(ds) == 5
    b = ds.batch([0, 4])
    x, y = b.inputs, b.targets
    assert b.document_ids is None and b.positions is None
    assert x.dtype == torch.int64 and x.shape == (2, 8)
    assert x[1].tolist() == list(range(32, 40)) and y[1].tolist() == list(range(33, 41))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_cli_data_prepare(tmp_path, capsys) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello world " * 50)
    b.write_text("second file\n")
    out = tmp_path / "data.bin"
    assert main(["data", "prepare", str(a), str(b), "--out", str(out)]) == 0
    tokens, vocab = open_token_file(out)
    assert bytes(tokens) == a.read_bytes() + b"\n\n" + b.read_bytes()
    assert "tokens" in capsys.readouterr().out
    ds = build_dataset(str(out), 16)
    assert len(ds) == (len(tokens) - 1) // 16
    assert main(["data", "info", str(out)]) == 0
    assert main(["data", "prepare", str(tmp_path / "missing.txt"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def _drain(sampler: DistributedBatchSampler, steps: int) -> list[list[int]]:
    return [np.concatenate(sampler.next_step()).tolist() for _ in range(steps)]


def test_sampler_ranks_partition_the_global_batch() -> None:
    single = DistributedBatchSampler(100, 8, seed=3)
    ranks = [DistributedBatchSampler(100, 8, dp_rank=r, dp_size=2, micro_batches=2, seed=3) for r in range(2)]
    for _ in range(30):  # crosses several epochs (12 steps per epoch)
        want = np.concatenate(single.next_step()).tolist()
        parts = [r.next_step() for r in ranks]
        assert all(len(p) == 2 and all(len(m) == 2 for m in p) for p in parts)
        # micro-batch i of all ranks together is micro-batch i of 1 process with the same grad_accum
        assert np.concatenate([p[i] for i in range(2) for p in parts]).tolist() == want
        assert len(set(want)) == 8
    assert single.epoch == 2


def test_sampler_epochs_are_permutations_and_seeded() -> None:
    s = DistributedBatchSampler(64, 8, seed=1)
    epoch0 = sum(_drain(s, 8), [])
    assert sorted(epoch0) == list(range(64))
    epoch1 = sum(_drain(s, 8), [])
    assert sorted(epoch1) == list(range(64)) and epoch1 != epoch0
    assert sum(_drain(DistributedBatchSampler(64, 8, seed=2), 8), []) != epoch0
    assert sum(_drain(DistributedBatchSampler(64, 8, seed=1, shuffle=False), 8), []) == list(range(64))


def test_sampler_state_restores_exactly() -> None:
    a = DistributedBatchSampler(50, 6, dp_rank=1, dp_size=2, seed=9)
    _drain(a, 11)
    state = a.state_dict()
    expected = _drain(a, 20)
    b = DistributedBatchSampler(50, 6, dp_rank=1, dp_size=2, seed=0)
    b.load_state_dict(dict(state))
    assert _drain(b, 20) == expected
    with pytest.raises(ConfigError, match="same data"):
        DistributedBatchSampler(40, 6).load_state_dict(state)


def test_sampler_errors() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        DistributedBatchSampler(100, 6, dp_size=4)
    with pytest.raises(ConfigError, match="fewer than train.batch_size"):
        DistributedBatchSampler(4, 8)
