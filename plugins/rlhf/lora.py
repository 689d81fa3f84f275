"""LoRA adapters on the GPT's linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): ``y = x W^T + (alpha / r) * dropout(x) A^T B^T`` with ``A [r, in]`` (Kaiming-uniform, as
PEFT) and ``B [out, r]`` zero, so a fresh adapter leaves the model unchanged. The base weights are frozen.

Adapted layers keep their class's parameter names (``wq.weight``) and add ``wq.lora_A`` / ``wq.lora_B``, so
checkpoints of the base weights keep their layout. :func:`adapters_disabled` runs the base model (DPO's reference
under LoRA: no second copy of the weights); :func:`merge_lora` folds the adapters into plain weights.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from crosstrain.errors import ConfigError


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made in place from an existing Linear by :func:`add_lora`."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float
    lora_enabled: bool
    lora_dropout: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.adapter_output(x) if self.lora_enabled else out

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        """The low-rank update ``(alpha / r) * dropout(x) A^T B^T`` of input ``x``. A layer that computes its base
        output otherwise (fake-quantised, for QAT) adds this term to it while ``lora_enabled``."""
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.lora_scaling


#: the ``lora.targets`` entry that selects every linear layer but the output head (PEFT's ``"all-linear"``)
ALL_LINEAR = "all-linear"


def output_head(model: nn.Module) -> nn.Module | None:
    """The LM (or scalar) head: transformers' ``get_output_embeddings()``, the GPT's ``output``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else getattr(model, "output", None)


def lora_layers(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Linear]]:
    """The plain ``nn.Linear`` layers of ``model`` that ``targets`` selects, by attribute name (``wq``,
    ``q_proj``) or, with ``"all-linear"``, all of them except the output head (as PEFT) and layers marked
    ``forward_unused`` (their owner reads the weight without calling the layer, as the MoE router's does)."""
    head = output_head(model) if ALL_LINEAR in targets else None
    return [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear
            and (name.rsplit(".", 1)[-1] in targets or (ALL_LINEAR in targets and module is not head
                                                         and not getattr(module, "forward_unused", False)))]


def no_match_error(model: nn.Module, targets: list[str], name: str) -> ConfigError:
    """The one-line error for ``targets`` that select no layer of ``model``: the names it could use instead."""
    head = output_head(model)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) is nn.Linear and m is not head})
    if names:
        return ConfigError(f"lora.targets={targets} matches no nn.Linear of model {name!r}; use names of its linear "
                           f"layers ({', '.join(names[:10])}) or \"{ALL_LINEAR}\"")
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear) and m is not head})
    return ConfigError(f"lora.targets={targets} matches no nn.Linear of model {name!r}: it has no plain nn.Linear "
                       f"({', '.join(kinds) or 'no linear layer'} keep their own forward, which LoRA does not wrap); "
                       "set lora.rank=0")


def add_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: list[str]) -> list[str]:
    """Freeze ``model`` and turn every ``nn.Linear`` that ``targets`` selects (:func:`lora_layers`) into a
    LoRALinear; returns the adapted module names."""
    model.requires_grad_(False)
    adapted = []
    for name, module in lora_layers(model, targets):
        a = torch.empty(rank, module.in_features, device=module.weight.device, dtype=module.weight.dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        module.__class__ = LoRALinear
        module.lora_A = nn.Parameter(a)
        module.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, device=a.device, dtype=a.dtype))
        module.lora_scaling = alpha / rank  # type: ignore[assignment]
        module.lora_enabled = True  # type: ignore[assignment]
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        adapted.append(name)
    return adapted


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base (every adapter off) inside the block."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.lora_enabled = True


def merge_lora(state_dict: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Plain weights from a state dict with adapters: ``W + scaling * B @ A`` for each ``X.lora_A``/``X.lora_B``."""
    out = {k: v for k, v in state_dict.items() if not k.endswith((".lora_A", ".lora_B"))}
    for key in state_dict:
        if key.endswith(".lora_A"):
            stem = key[: -len(".lora_A")]
            a, b = state_dict[key], state_dict[stem + ".lora_B"]
            w = out[stem + ".weight"]
            out[stem + ".weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out
