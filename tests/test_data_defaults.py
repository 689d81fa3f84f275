"""Data defaults: the validation split holds data.val_fraction of the tokens (two JSONL files, 5% +/- 1%), is
printed in one line and is the same on every call; evaluation runs eval.max_batches batches by default (the whole
split one flag away); a 300-row preference set evaluates with the eval batch fitted to its 15 held-out rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from in_process import crosstrain_main
from one_line import raises_one_line

from crosstrain.config import load_config
from crosstrain.data.dataset import build_datasets
from crosstrain.data.split import split_tokens
from crosstrain.data.tokenfile import open_token_file
from crosstrain.engine.evaluate import fit_eval_batch

TINY = ["train.batch_size=4", "train.seq_len=32", "logging.progress=none", "logging.tensorboard=false",
        "backend=cpu", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "schedule.warmup_steps=0",
        "parallel.compile=false"]


def _jsonl(path, texts) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _two_files(tmp_path):
    """Two JSONL inputs whose last document is half of all text: a whole-document split held out 50%."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _jsonl(a, [f"document {i}: " + "the quick brown fox jumps. " * (40 + i) for i in range(30)])
    _jsonl(b, ["one long document that is half the data. " * 1100])
    out = tmp_path / "tokens.bin"
    assert crosstrain_main(["data", "prepare", str(a), str(b), "--out", str(out)]) == 0
    return out


def test_two_jsonl_files_hold_out_five_percent_of_tokens(tmp_path, capsys) -> None:
    tokens = _two_files(tmp_path)
    data = load_config(None, [f"data.path={tokens}", "data.val_fraction=0.05"]).data
    train, val, info = build_datasets(data, 32)
    total = info["train_tokens"] + info["val_tokens"]
    assert val is not None and len(val.tokens) == info["val_tokens"] and len(train.tokens) == info["train_tokens"]
    assert info["val_tokens"] / total == pytest.approx(0.05, abs=0.01)
    # the last document is half the tokens, so the cut falls inside it at a token boundary: no token in both
    assert info["document_split"] and info["val_documents"] == 1 and info["documents"] == 31
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), open_token_file(str(tokens))[0])
    assert build_datasets(data, 32)[2] == info  # deterministic: every rank and every run cut the same token
    run_dir = tmp_path / "run"
    assert crosstrain_main(["train", "--run-dir", str(run_dir), *(f"--set={s}" for s in TINY),
                            f"--set=data.path={tokens}", "--set=train.steps=1", "--set=eval.every=1"]) == 0
    out = capsys.readouterr().out
    line = f"data: {info['train_tokens']:,} train / {info['val_tokens']:,} val tokens"
    assert sum(line in x for x in out.splitlines()) == 1, out
    assert json.loads((run_dir / "data_split.json").read_text())["val_tokens"] == info["val_tokens"]


def test_split_snaps_to_a_near_document_boundary_and_keeps_both_sides() -> None:
    tokens = np.arange(1000, dtype=np.int64)
    starts = np.array([0, 300, 955])  # 45 held-out tokens is within 10% of the 50 asked: no document is cut
    split = split_tokens(tokens, starts, 0.05)
    assert split.info["split_at_token"] == 955 and not split.info["document_split"]
    far = split_tokens(tokens, np.array([0, 300, 900]), 0.05)  # the nearest boundary is 100 tokens away
    assert far.info["split_at_token"] == 950 and far.info["document_split"] and far.info["val_documents"] == 1
    assert far.val is not None and far.val.tolist() == list(range(950, 1000))
    bare = split_tokens(tokens, None, 0.999)  # no recorded boundaries: still a split, one token left to train
    assert bare.info["train_tokens"] == 1 and "documents" not in bare.info
    assert split_tokens(tokens, starts, 0.0).val is None


def test_eval_runs_max_batches_by_default_and_all_on_request(tmp_path) -> None:
    from crosstrain.engine.run import build_run

    assert load_config(None, []).eval.max_batches == 20
    assert load_config(None, ["eval.max_batches=all"]).eval.max_batches == 0
    assert load_config(None, ["eval.steps=3"]).eval.max_batches == 3  # the old name still works
    raises_one_line(lambda: load_config(None, ["eval.steps=3", "eval.max_batches=2"]), "old name", "eval.max_batches")
    sets = [*TINY, "eval.batch_size=2", "data.val_fraction=0.2"]
    for value, expected in (("20", 20), ("all", None)):
        run = build_run(load_config(None, [*sets, f"eval.max_batches={value}",
                                           f"train.output_dir={tmp_path}"]), for_eval=True)
        try:
            assert run.eval is not None
            full = len(run.eval.dataset) // 2
            assert full > 20 and run.eval.batches == (expected or full)
        finally:
            run.close()


def test_small_preference_set_fits_the_eval_batch(tmp_path, capsys) -> None:
    rows = tmp_path / "prefs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}: say it ", "chosen": f"YES {i}", "rejected": f"no {i}"})
                            + "\n" for i in range(300)))
    run_dir = tmp_path / "dpo"
    sets = [*TINY, "train.batch_size=16", "train.steps=1", "eval.every=1", f"data.path={rows}",
            "rlhf.max_length=32", "rlhf.max_prompt_length=16"]
    assert crosstrain_main(["train", "--recipe", "dpo", "--run-dir", str(run_dir),
                            *(f"--set={s}" for s in sets)]) == 0
    err = capsys.readouterr().err
    assert "eval batch 16 -> 15: the validation data has only 15 samples" in err, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert np.isfinite(summary["eval_loss"])
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in r for r in evals)
    # an eval.batch_size the user set is kept, and refused with the value that fits
    raises_one_line(lambda: fit_eval_batch(15, 16, True, 1, 1), "15 samples", "set eval.batch_size=15")
    assert fit_eval_batch(15, 16, False, 2, 1) == (14, "crosstrain: eval batch 16 -> 14: the validation data has "
                                                      "only 15 samples (set eval.batch_size to choose another)")
    raises_one_line(lambda: fit_eval_batch(1, 4, False, 2, 1), "1 samples", "hold out more data")
