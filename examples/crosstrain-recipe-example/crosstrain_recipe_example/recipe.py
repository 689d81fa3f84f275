"""``lm_kl``: next-token loss plus ``beta * KL(policy || reference)`` to a frozen copy of the initial model.

The KL penalty keeps a fine-tuned policy near its reference, as in Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences" (arXiv:1909.08593), here computed exactly over the vocabulary per token.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.data import TokenBatch
from crosstrain.engine.recipe import MicroBatchLoss, ModelSpec
from crosstrain.recipes.lm import LMRecipe, build_model, next_token_loss


def token_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``sum_v p(v) (log p(v) - log q(v))``, ``p`` = softmax(policy), ``q`` = softmax(ref)."""
    logp = F.log_softmax(policy_logits.float(), dim=-1)
    logq = F.log_softmax(reference_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


class LMKLRecipe(LMRecipe):
    """The ``lm`` recipe's data and loss, plus a frozen ``reference`` model and a KL term."""

    name = "lm_kl"
    supports_pipeline = False
    loss_is_token_nll = False  # ce + beta * KL: exp(loss) would not be a perplexity

    def build_models(self, context: Any) -> dict[str, ModelSpec]:
        self.beta = float(context.config.section("lm_kl").beta)
        policy = build_model(context.config)
        reference = copy.deepcopy(policy)
        source = f"initial weights (train.seed={context.config.train.seed})"
        # transform=True: plugin transforms (e.g. MoE layers) apply to the copy too, so it stays the policy's start
        return {"policy": ModelSpec(policy),
                "reference": ModelSpec(reference, trainable=False, source=source, transform=True)}

    def loss(self, models: Mapping[str, nn.Module], batch: TokenBatch) -> MicroBatchLoss:
        # data.packing = "documents": keep attention inside each document
        docs = {} if batch.document_ids is None else {"doc_ids": batch.document_ids}
        logits = models["policy"](batch.inputs, **docs)
        with torch.no_grad():
            reference_logits = models["reference"](batch.inputs, **docs)
        ce = next_token_loss(logits, batch.targets)
        kl = token_kl(logits, reference_logits)
        return MicroBatchLoss(ce + self.beta * kl, {"ce": ce.detach(), "kl": kl.detach()})
