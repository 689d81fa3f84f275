"""OpenAI's two log-prob shapes, from a finished job's :class:`~crosstrain.generation.Sequence`.

- ``/v1/completions`` (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
  token; ``top_logprobs`` maps token text to log-prob for the ``logprobs`` most likely tokens plus the chosen one
  (vLLM's rule: at most ``logprobs + 1`` entries; tokens that share a text keep the likeliest). With ``echo``
  the prompt's tokens come first; the first has ``null`` log-prob and alternatives (nothing precedes it), the
  shape lm-evaluation-harness's ``local-completions`` reads for loglikelihood requests.
- ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` with exactly
  ``top_logprobs`` alternatives.

The tokens listed are the ones whose text the reply holds, and a stop string cuts the list after the token that
completes the text before it. A stop token (EOS) is not part of the text: chat's list leaves it out, completions'
ends with it, so ``echo`` with ``max_tokens`` n lists the prompt's tokens plus the n generated whatever they are.
lm-eval's ``local-completions`` relies on that: it scores a continuation by sending it with ``echo`` and
``max_tokens`` 1 and reading every entry but the last, so an EOS left out would silently drop the continuation's
last token from its score.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from crosstrain.generation.logprobs import Alternatives
from crosstrain.plugins.serve.requests import Job


def reply_tokens(job: Job, stop_token: bool = False) -> tuple[list[int], list[float], list[Alternatives]]:
    """The generated tokens that make up ``job.text``, their log-probs and alternatives; with ``stop_token``, also
    the stop token that ended the reply."""
    seq = job.seq
    if seq is None:
        return [], [], []
    tokens = list(seq.tokens)
    stopped = bool(tokens) and tokens[-1] in seq.config.stop_tokens
    n = len(tokens) - stopped
    if job.decode(tokens[:n]) != job.text:  # a stop string cut the text: keep the tokens that reach its end
        while n > 0 and job.decode(tokens[:n - 1]).startswith(job.text):
            n -= 1
    elif stopped and stop_token:
        n += 1
    return tokens[:n], seq.logprobs[:n], seq.top[:n]


def completion_logprobs(job: Job, echo: bool) -> dict[str, Any]:
    seq = job.seq
    tokens, logprobs, tops = reply_tokens(job, stop_token=True)
    chosen: list[float | None] = list(logprobs)
    alternatives: list[Alternatives | None] = list(tops)
    if echo and seq is not None:
        tokens = [*seq.prompt, *tokens]
        chosen = [*seq.prompt_logprobs, *chosen]
        alternatives = [None, *seq.prompt_top[1:], *alternatives]
    texts = [job.decode([t]) for t in tokens]
    top: list[dict[str, float] | None] = []
    for token, logprob, alts in zip(tokens, chosen, alternatives, strict=True):
        if alts is None or logprob is None:
            top.append(None)
            continue
        entry: dict[str, float] = {}
        for t, v in [*alts, (token, logprob)]:  # tokens with the same text (bytes of one character): the likeliest
            entry.setdefault(job.decode([t]), v)
        top.append(entry)
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets}


def _entry(decode: Callable[[list[int]], str], token: int, logprob: float) -> dict[str, Any]:
    text = decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(job: Job) -> dict[str, Any]:
    tokens, logprobs, tops = reply_tokens(job)
    content = []
    for token, logprob, alts in zip(tokens, logprobs, tops, strict=True):
        entry = _entry(job.decode, token, logprob)
        entry["top_logprobs"] = [_entry(job.decode, t, v) for t, v in alts]
        content.append(entry)
    return {"content": content}
