"""Tokenizer training, ``data.tokenizer``, and ``crosstrain data prepare`` on text, JSONL and Parquet.

Tokenizers are trained here on the embedded corpus or on generated documents; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.data.hf_tokenizer import HFTokenizer, describe_tokenizer  # noqa: E402
from crosstrain.data.manifest import document_starts, read_manifest  # noqa: E402
from crosstrain.data.prepare import prepare  # noqa: E402
from crosstrain.data.tokenfile import open_token_file  # noqa: E402
from crosstrain.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert main(["tokenizer", "train", "--vocab-size", "512", "--out", str(out)]) == 0  # the embedded corpus
    return out


def docs(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["harbour", "lantern", "quiet", "Ada", "found", "the", "é", "river", "€"]
    return [f"doc {i}: " + " ".join(rng.choice(words, int(rng.integers(1, 40)))) for i in range(n)]


def test_trained_tokenizer_loads_in_transformers_with_the_same_ids(tok_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = HFTokenizer(tok_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert ours.vocab_size == len(theirs) <= 512 and ours.eos_id == theirs.eos_token_id == 0
    for text in ["Ada found the lantern by the harbour.", "naïve café ☕ \n\n  spaces", docs(3)[2]]:
        ids = ours.encode(text).tolist()
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == text == theirs.decode(ids)
    from crosstrain.data.corpus import corpus_bytes

    sample = corpus_bytes()[:4000]
    assert len(ours.encode(sample)) < 0.5 * len(sample)  # it learned the corpus's words


def test_tokenizer_train_on_jsonl_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs()))
    out = tmp_path / "t"
    args = ["tokenizer", "train", str(data), "--text-field", "body", "--vocab-size", "300", "--out", str(out)]
    assert main(args) == 0
    assert describe_tokenizer(str(out))["vocab_size"] == 300
    assert main(["tokenizer", "train", "--vocab-size", "100", "--out", str(out)]) == 2
    assert "too small" in capsys.readouterr().err


def _write_inputs(tmp_path: Path, texts: list[str]) -> list[str]:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    third = len(texts) // 3
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[:third])))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": texts[third:2 * third]}), parquet, row_group_size=17)
    text = tmp_path / "c.txt"
    text.write_text("\n".join(texts[2 * third:]))
    return [str(jsonl), str(parquet), str(text)]


def test_prepare_jsonl_parquet_text_with_eos_manifest_and_any_worker_count(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from crosstrain.data import sources

    monkeypatch.setattr(sources, "JSONL_UNIT_BYTES", 1024)  # many JSONL units, so two workers really share them
    texts = docs()
    inputs = _write_inputs(tmp_path, texts)
    manifests = [prepare(inputs, tmp_path / f"w{w}.bin", tokenizer=str(tok_dir), workers=w) for w in (1, 2)]
    assert manifests[1]["workers"] == 2
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    tokens, vocab = open_token_file(tmp_path / "w2.bin")
    tok = HFTokenizer(tok_dir)
    third = len(texts) // 3
    documents = [*texts[: 2 * third], "\n".join(texts[2 * third:])]  # the text file is one document
    expected = []
    for i, d in enumerate(documents):
        expected += ([tok.eos_id] if i else []) + tok.encode(d).tolist()
    assert tokens.tolist() == expected and vocab == tok.vocab_size
    manifest = read_manifest(tmp_path / "w2.bin")
    assert manifest is not None and manifest["documents"] == len(documents) and manifest["tokens"] == len(tokens)
    assert manifest["tokenizer"]["sha256"] == describe_tokenizer(str(tok_dir))["sha256"]
    assert [i["documents"] for i in manifest["inputs"]] == [third, third, 1]
    starts = document_starts(tmp_path / "w2.bin", len(tokens))
    assert starts is not None and starts[0] == 0 and len(starts) == len(documents)
    assert all(tokens[s - 1] == tok.eos_id for s in starts[1:])
    assert tok.decode(tokens[starts[5]:starts[6] - 1]) == documents[5]


def test_prepare_byte_default_and_embedded_corpus(tmp_path: Path) -> None:
    from crosstrain.data.corpus import corpus_bytes

    out = tmp_path / "c.bin"
    assert main(["data", "prepare", "--out", str(out)]) == 0  # no files: the embedded corpus, byte tokenizer
    tokens, vocab = open_token_file(out)
    assert vocab == 256 and bytes(tokens) == corpus_bytes().rstrip(b"\n")
    manifest = read_manifest(out)
    assert manifest is not None and manifest["tokenizer"]["type"] == "byte" and manifest["documents"] > 10


def test_prepare_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"content": "hi"}) + "\n")
    assert main(["data", "prepare", str(bad), "--out", str(tmp_path / "x.bin")]) == 2
    assert "no 'text' field" in capsys.readouterr().err
    assert main(["data", "prepare", str(bad), "--text-field", "content", "--out", str(tmp_path / "x.bin")]) == 0


def test_training_checks_the_data_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    from crosstrain.config import gpt_config, load_config
    from crosstrain.recipes.lm import LMRecipe

    data = tmp_path / "d.bin"
    prepare([], data, tokenizer=str(tok_dir))
    with pytest.raises(ConfigError, match="prepared with tokenizer"):
        LMRecipe().validate(load_config(None, [f"data.path={data}"]))
    config = load_config(None, [f"data.path={data}", f"data.tokenizer={tok_dir}"])
    LMRecipe().validate(config)
    assert gpt_config(config).vocab_size == describe_tokenizer(str(tok_dir))["vocab_size"]
    with pytest.raises(ConfigError, match="needs a token file prepared with it"):
        load_config(None, [f"data.tokenizer={tok_dir}"])


def test_train_with_tokenizer_then_export_and_generate_text(
    tok_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    data = tmp_path / "d.bin"
    prepare([], data, tokenizer=str(tok_dir))
    run = tmp_path / "run"
    Trainer(load_config(None, [f"data.path={data}", f"data.tokenizer={tok_dir}", "logging.progress=none",
                               "train.steps=6", "train.seq_len=32", "train.batch_size=8", "checkpoint.every=6",
                               "eval.every=0"]), run_dir=run).fit()
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "Ada found", "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_ids"] == tok("Ada found")["input_ids"]
    ids = torch.tensor([result["prompt_ids"]])
    with torch.no_grad():
        greedy = hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    new = greedy[0, ids.shape[1]:].tolist()
    assert new[: len(result["new_ids"])] == result["new_ids"]  # both stop at EOS
    assert result["text"] == tok.decode(result["new_ids"])
