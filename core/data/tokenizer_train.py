"""``crosstrain tokenizer train``: a byte-level BPE tokenizer trained with the ``tokenizers`` package.

GPT-2-style byte-level BPE (Radford et al. 2019; the ``ByteLevel`` pre-tokenizer and decoder of ``tokenizers``):
the 256 byte symbols are always in the vocabulary, so any text encodes without an unknown token, and one special
token ``<|endoftext|>`` (id 0) separates documents. The folder holds ``tokenizer.json`` and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, which is what transformers' ``AutoTokenizer`` loads.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from crosstrain.checkpoint.atomic import atomic_path, atomic_write
from crosstrain.errors import ConfigError

EOS = "<|endoftext|>"


def _documents(inputs: list[str], text_field: str) -> Iterator[str]:
    from crosstrain.data.sources import iter_documents, plan_units

    for unit in plan_units(inputs):
        for doc in iter_documents(unit, text_field):
            yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc


def train_bpe(
    inputs: list[str], vocab_size: int, out: str | os.PathLike[str], *, text_field: str = "text",
    min_frequency: int = 2, model_max_length: int = 2048,
) -> Path:
    """Train on the documents of ``inputs`` (text, JSONL or Parquet files; none = the embedded corpus) and write
    the tokenizer folder ``out``. Returns the folder."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError("crosstrain tokenizer train needs the 'tokenizers' package; "
                          "pip install 'crosstrain[hf]'") from None
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size} is too small: the 256 byte symbols and {EOS} need 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs: Iterable[str]
    if inputs:
        docs = _documents(inputs, text_field)
    else:
        from crosstrain.data.sources import corpus_documents

        docs = corpus_documents()
    tok.train_from_iterator(docs, trainer=trainer)
    got = tok.get_vocab_size()
    if got < vocab_size:  # BPE stops when no pair occurs min_frequency times: the corpus is too small for more
        print(f"crosstrain: the tokenizer has {got} tokens, fewer than --vocab-size {vocab_size}: the corpus has "
              f"no more pairs occurring >= {min_frequency} times; give more text for a larger vocabulary",
              file=sys.stderr)
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    with atomic_path(root / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "bos_token": EOS, "eos_token": EOS, "unk_token": None,
              "pad_token": None}
    atomic_write(root / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return root
