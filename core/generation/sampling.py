"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus) filtering, and log-probs.

Pure functions on ``[B, vocab]`` tensors, shared by :func:`crosstrain.generation.generate` and the export
plugin's ``crosstrain generate`` loop.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits / temperature`` with tokens outside the top-k and the top-p nucleus set to ``-inf`` (fp32).

    Top-k keeps the ``k`` largest logits (ties at the k-th value are kept). Top-p keeps the smallest set of most
    likely tokens whose probability reaches ``p``: a token stays when the mass strictly before it, in descending
    order, is below ``p``, so the most likely token always stays (Holtzman et al. 2020, "The Curious Case of
    Neural Text Degeneration"; the same set as transformers' ``TopPLogitsWarper``).
    """
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_p = sorted_logits.softmax(-1)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
        drop_sorted[..., 0] = False  # a top_p under fp32's smallest (1e-300) compares as 0 and would drop them all
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs [B, vocab]`` whose cumulative-probability interval holds that row's
    ``uniform [B]`` in ``[0, 1)``: a draw from ``probs`` (inverse transform sampling) that depends on the row's
    own noise only, so a row samples the same token whatever batch it is in. Zero-probability tokens have empty
    intervals and are never chosen."""
    cdf = probs.float().cumsum(-1)
    target = uniform.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    return (cdf <= target).sum(-1).clamp(max=probs.shape[-1] - 1)


#: below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): ``logits / 2e-38`` overflows to inf and the
#: softmax to NaN, which ``torch.multinomial`` refuses mid-decode
MIN_TEMPERATURE = 1e-5


def next_tokens(logits: torch.Tensor, *, greedy: bool, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None,
                uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [B, vocab]``: the argmax, or a draw from the filtered softmax: by
    :func:`inverse_cdf` of the per-row ``uniform [B]`` noise when given, else ``torch.multinomial`` with
    ``generator`` (which must live on the logits' device). A temperature under :data:`MIN_TEMPERATURE` is greedy."""
    if greedy or temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    if uniform is not None:
        return inverse_cdf(probs, uniform)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[token]`` per row in fp32: the policy's own log-probability, before any
    temperature or filtering (what importance ratios and KL estimates in RL need)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
