"""``crosstrain export <Hugging Face folder> --format hf`` (issue 40): a folder of a family no native family imports
(GPT-NeoX) goes through the generic path (``save_pretrained``), a native one (Llama) through the native adapter; each
export, run as a real ``crosstrain export`` process, loads in transformers with the source folder's logits (1e-5)
and keeps the folder's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_tokenizer import build_model, build_tokenizer

pytest.importorskip("transformers")


def _neox(folder: Path) -> Path:
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    build_tokenizer(folder)
    config = GPTNeoXConfig(vocab_size=len(AutoTokenizer.from_pretrained(folder)), hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=128, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms and biases off their init (ones / zeros): a dropped one would show
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def _export(folder: Path, out: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "export", str(folder), "--format", "hf", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "config.json").read_text())  # type: ignore[no-any-return]


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_exported_folder_loads_in_transformers_with_the_source_logits(family: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = _neox(tmp_path / "src") if family == "gpt_neox" else build_model(tmp_path / "src")
    config = _export(folder, tmp_path / "out")
    assert config["model_type"] == family
    ids = AutoTokenizer.from_pretrained(tmp_path / "out")("The quick brown fox jumps", return_tensors="pt").input_ids
    assert ids.shape[1] > 3
    assert ids.tolist() == AutoTokenizer.from_pretrained(folder)("The quick brown fox jumps",
                                                                 return_tensors="pt").input_ids.tolist()
    ref, got = _logits(folder, ids), _logits(tmp_path / "out", ids)
    assert ref.abs().max() > 1e-2  # not a degenerate model
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
