"""Log-probabilities a server reports beside the tokens (OpenAI's ``logprobs``/``top_logprobs``, ``echo``): the
chosen token's and the most likely alternatives', all ``log_softmax`` of the model's own logits at that position
(before temperature or filtering, as :func:`~crosstrain.generation.sampling.token_logprobs`; what OpenAI and vLLM
report and what lm-evaluation-harness sums for loglikelihood tasks)."""

from __future__ import annotations

import torch

#: one position: (token id, log-prob) of its ``k`` most likely tokens, most likely first
Alternatives = list[tuple[int, float]]


def top_alternatives(logits: torch.Tensor, k: int) -> list[Alternatives]:
    """The ``k`` most likely tokens of each row of ``logits [N, vocab]`` with their log-probs (fp32)."""
    if k <= 0:
        return [[] for _ in range(logits.shape[0])]
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> tuple[list[float | None], list[Alternatives]]:
    """Each prompt token's log-prob given the tokens before it, from the prefill's ``logits [len(prompt), vocab]``
    (position ``i`` predicts token ``i + 1``), and each position's ``k`` alternatives. The first token has nothing
    before it: ``None`` and no alternatives (OpenAI's ``echo`` shape)."""
    if len(prompt) < 2:
        return [None] * len(prompt), [[] for _ in prompt]
    scored = logits[:len(prompt) - 1].float()
    nexts = torch.tensor(prompt[1:], dtype=torch.long, device=scored.device)
    chosen = torch.log_softmax(scored, dim=-1).gather(-1, nexts.unsqueeze(-1)).squeeze(-1).tolist()
    return [None, *chosen], [[], *top_alternatives(scored, k)]
