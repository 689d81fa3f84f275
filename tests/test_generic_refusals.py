"""The generic path refuses what it cannot train (issue 40), in one line, exit 2, before anything is written: an
encoder (BERT, ELECTRA, CamemBERT, XLM: bidirectional attention), an encoder-decoder (T5), a Llama folder whose
config.json says gpt2, and a checkpoint with one tensor missing and one extra. A tied head is not "missing", and
``crosstrain models`` lists no encoder as trainable. What is accepted of a masked-LM type (BERT with ``is_decoder``,
XLM with ``causal``) attends causally: changing the last tokens leaves the earlier positions' logits unchanged.

Each folder is a random tiny model built with transformers' own classes and saved with ``save_pretrained``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from causal_check import prefix_moves
from in_process import crosstrain_main
from one_line import one_line_error

pytest.importorskip("transformers")

SHAPE = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "max_position_embeddings": 128}
T5 = {"vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}


def _save(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, T5ForConditionalGeneration

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("refused")
    out = {mt: _save(AutoModel.from_config(AutoConfig.for_model(mt, **SHAPE)), root / mt)
           for mt in ("bert", "electra", "camembert")}
    out["t5"] = _save(T5ForConditionalGeneration(AutoConfig.for_model("t5", **T5)), root / "t5")
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE, num_key_value_heads=2))
    out["gpt2_typed_llama"] = _save(llama, root / "gpt2_typed_llama")
    config = json.loads((root / "gpt2_typed_llama" / "config.json").read_text())
    (root / "gpt2_typed_llama" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    neox = _save(AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_neox", **SHAPE)), root / "misfit")
    tensors = load_file(neox / "model.safetensors")
    tensors["extra.weight"] = tensors.pop("gpt_neox.layers.0.mlp.dense_4h_to_h.weight")  # one missing, one extra
    save_file(tensors, neox / "model.safetensors", metadata={"format": "pt"})
    out["misfit"] = neox
    tied = AutoConfig.for_model("llama", **SHAPE, num_key_value_heads=2, tie_word_embeddings=True)
    out["tied"] = _save(AutoModelForCausalLM.from_config(tied), root / "tied")
    for name, causal in (("xlm", False), ("xlm_causal", True)):  # XLM's own switch to a causal mask
        xlm = AutoConfig.for_model("xlm", vocab_size=256, emb_dim=32, n_layers=2, n_heads=4, causal=causal)
        out[name] = _save(AutoModelForCausalLM.from_config(xlm), root / name)
    decoder = AutoConfig.for_model("bert", **SHAPE, is_decoder=True)
    out["bert_decoder"] = _save(AutoModelForCausalLM.from_config(decoder), root / "bert_decoder")
    return out


def _train(folder: Path, out: Path) -> int:
    return crosstrain_main(["train", "--set", f"model.init_from={folder}", "--set", "model.source=transformers",
                            "--set", f"train.output_dir={out}", "--set", "train.steps=1", "--set", "train.batch_size=2",
                            "--set", "train.seq_len=16", "--set", "backend=cpu", "--set", "logging.progress=none",
                            "--set", "eval.every=0", "--set", "checkpoint.every=0"])


@pytest.mark.parametrize(("name", "words"), [
    ("bert", ("encoder", "BertModel", "is_decoder=false", "decoder-only")),
    ("electra", ("encoder", "is_decoder=false")),
    ("camembert", ("encoder", "is_decoder=false")),
    ("t5", ("encoder-decoder", "T5ForConditionalGeneration", "decoder-only")),
    ("xlm", ("encoder", "causal=false", "decoder-only")),
    ("gpt2_typed_llama", ("GPT2LMHeadModel", "missing", "unexpected", "model.embed_tokens.weight", "model_type")),
    ("misfit", ("1 missing (gpt_neox.layers.0.mlp.dense_4h_to_h.weight)", "1 unexpected (extra.weight)")),
])
def test_refused_in_one_line_with_exit_2_and_no_run_dir(folders: dict[str, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], name: str,
                                                        words: tuple[str, ...]) -> None:
    out = tmp_path / "runs"
    assert _train(folders[name], out) == 2
    captured = capsys.readouterr()
    line = one_line_error(captured.out, captured.err, lines=1)[0]
    for word in words:
        assert word in line, line
    assert not out.exists()


@pytest.mark.parametrize("name", ["xlm_causal", "bert_decoder", "tied"])
def test_accepted_masked_lm_configs_attend_causally_and_train(folders: dict[str, Path], tmp_path: Path,
                                                              name: str) -> None:
    from transformers import AutoModelForCausalLM

    from crosstrain.config import load_config
    from crosstrain.recipes.lm import build_model

    refused = AutoModelForCausalLM.from_pretrained(folders["xlm"]).eval()
    assert prefix_moves(lambda ids: refused(ids).logits) > 1e-3  # the check sees a bidirectional model
    model = build_model(load_config(None, [f"model.init_from={folders[name]}", "model.source=transformers"])).eval()
    assert prefix_moves(model) == 0.0  # crosstrain's model of the folder
    assert _train(folders[name], tmp_path / "runs") == 0


def test_a_tied_head_is_not_missing(folders: dict[str, Path], tmp_path: Path) -> None:
    from crosstrain.config import load_config
    from crosstrain.recipes.lm import build_model

    model = build_model(load_config(None, [f"model.init_from={folders['tied']}", "model.source=transformers"]))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_models_lists_no_encoder_as_trainable() -> None:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert crosstrain_main(["models", "--json"]) == 0
    found = {f["family"]: f for f in json.loads(stdout.getvalue())["families"]}
    trainable = set(found["generic"]["model_types"])
    assert "gpt_neox" in trainable and "falcon" in trainable
    assert "encoders (is_decoder=false) and encoder-decoders" in found["generic"]["refuses"]
    assert not trainable & {"bert", "electra", "camembert", "roberta", "t5", "bart", "whisper"}, trainable
