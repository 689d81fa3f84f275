"""A Llama-3-style tokenizer and a tiny Llama-shaped Hugging Face model, built locally (nothing is downloaded).

``build_tokenizer(folder)`` trains a byte-level BPE (``tokenizers``) on the embedded corpus, adds Llama 3's special
tokens (``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``),
a post-processor that prepends ``<|begin_of_text|>`` as Llama 3's ``tokenizer.json`` does, and Llama 3's chat
template (:data:`LLAMA3_TEMPLATE`, the shape of Meta-Llama-3-8B-Instruct's ``chat_template``), and saves it with
transformers' ``PreTrainedTokenizerFast.save_pretrained``. :data:`LLAMA3_TEMPLATE_MARKED` renders the same text with
``{% generation %}`` markers around each assistant turn's content and ``<|eot_id|>``: pass it as ``chat_template=``
with ``return_assistant_tokens_mask=True`` to get the mask TRL's ``assistant_only_loss`` trains on.

``build_model(folder)`` saves a random-init ``LlamaForCausalLM`` (2 layers, dim 64, GQA 4/2 heads) whose vocabulary
matches the tokenizer, plus the tokenizer files and a ``generation_config.json`` listing ``<|end_of_text|>`` and
``<|eot_id|>`` as ``eos_token_id`` (as Llama-3-Instruct does). ``CONVERSATIONS`` are small multi-turn rows.

Use them as ``from chat_tokenizer import build_model, build_tokenizer`` (tests/ is not a package); both take
about a second, so build once per module with a ``tmp_path_factory`` fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, START, END, EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
SPECIAL = [BOS, EOS, START, END, EOT]
VOCAB_SIZE = 512  # BPE merges + the 256 byte symbols + SPECIAL; the model's embedding rows

#: Llama 3 Instruct's template: BOS, then each message as a header, its content stripped, and <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
#: the same rendering with transformers' {% generation %} markers on what the assistant writes (content + EOT).
LLAMA3_TEMPLATE_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

CONVERSATIONS: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour of the sky."},
            {"role": "assistant", "content": "Blue"},
            {"role": "user", "content": "And at night?"},
            {"role": "assistant", "content": "Black, mostly, with stars."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "One, two, three."},
            {"role": "user", "content": "Now backwards."},
            {"role": "assistant", "content": "Three, two, one."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "  Say hello.  "},
            {"role": "assistant", "content": "Hello there, friend!"},
        ]
    },
]


def build_tokenizer(folder: str | Path) -> Path:
    """Train and save the Llama-3-style tokenizer in ``folder`` (created); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from crosstrain.data.sources import corpus_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_documents(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, additional_special_tokens=[START, END, EOT]
    )
    fast.chat_template = LLAMA3_TEMPLATE
    out = Path(folder)
    fast.save_pretrained(out)
    return out


def build_model(folder: str | Path, *, seed: int = 0) -> Path:
    """Save a tiny random-init Llama-shaped HF model with the tokenizer and Llama-3-Instruct's stop tokens in
    ``generation_config.json`` into ``folder``; returns the folder."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = build_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.convert_tokens_to_ids(BOS),
        eos_token_id=tok.convert_tokens_to_ids(EOS),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    stops = [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT)]
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stops).save_pretrained(out)
    return out


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a JSONL file at ``path``; returns the path."""
    p = Path(path)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p
