"""The generic model: the transformers class itself, with crosstrain's interface mixed in.

:func:`adopt` swaps a built ``PreTrainedModel``'s class for a subclass that puts :class:`GenericCausalLM` first in
its MRO (as FSDP2's ``fully_shard`` does with its own class), so parameter names stay exactly those
``save_pretrained`` writes and every transformers method keeps working. The mixin adds what crosstrain's loop,
recipes and generation call: ``forward(tokens) -> logits``, the cache protocol of
:mod:`crosstrain.generation.engine` (through transformers' own ``DynamicCache``) and the parallel plans of
:mod:`crosstrain.parallel.plan` (see :mod:`.plans`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from crosstrain.errors import ConfigError

_CLASSES: dict[type, type] = {}


class HFCache:
    """transformers' ``DynamicCache`` with the integer ``length`` the generation engine reads."""

    def __init__(self, cache: Any, max_len: int) -> None:
        self.hf = cache
        self.length = 0
        self.max_len = max_len


class GenericCausalLM(nn.Module):
    """Mixed in before a transformers ``*ForCausalLM`` class by :func:`adopt` (never instantiated alone)."""

    config: Any
    _hf_class: type  # the transformers class this one extends

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,  # type: ignore[override]
                **hf_kwargs: Any) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``tokens [B, T]``; without ``hf_kwargs`` (training and scoring) no cache.
        ``hf_kwargs`` go to the transformers forward (:meth:`forward_cached` passes its cache through here)."""
        if doc_ids is not None:
            raise ConfigError("the generic (transformers) path takes no document ids; set data.packing='concat'")
        hf_kwargs.setdefault("use_cache", False)
        return super().forward(input_ids=tokens, **hf_kwargs).logits  # type: ignore[misc]

    # -- the generation cache protocol (crosstrain.generation.engine) ---------------------------------------------
    def allocate_kv_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                          device: torch.device | None = None) -> HFCache:
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.config)
        except TypeError:  # transformers < 4.56 builds it without the config
            cache = DynamicCache()
        return HFCache(cache, max_len)

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HFCache,
                       attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits for ``tokens [B, L]`` appended to ``cache``; ``attention_mask [B, cache.length + L]`` marks real
        tokens (transformers' 2-D padding mask), None when no row is padded."""
        # transformers 5.x renamed past_key_values to cache (the old name warns until its removal)
        key = "cache" if _takes(self._hf_class, "cache") else "past_key_values"
        kwargs: dict[str, Any] = {key: cache.hf, "use_cache": True}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.long()
        if _takes(self._hf_class, "position_ids"):  # ALiBi and learned-position models find positions from the mask
            kwargs["position_ids"] = positions
        # through __call__, unlike the native GPT: transformers calls its decoder layers through theirs, and FSDP2
        # must see the root's forward first (its hooks then find the parameters crosstrain.generation gathered)
        logits = self(tokens, **kwargs)
        cache.length += tokens.shape[1]
        return logits

    # -- parallel plans (crosstrain.parallel.plan) ---------------------------------------------------------------
    def ac_units(self) -> dict[str, int]:
        """The decoder layers (the classes in ``_no_split_modules``) -> their index: checkpointing/FSDP2 units."""
        from crosstrain.models.generic.plans import decoder_layers

        return decoder_layers(self)

    def tp_plan(self) -> dict[str, Any]:
        """The config's ``base_model_tp_plan`` as DTensor styles (:func:`.plans.tp_plan`)."""
        from crosstrain.models.generic.plans import tp_plan

        return tp_plan(self)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.get_input_embeddings().weight.numel()  # type: ignore[operator]
        return n


@functools.cache
def _takes(cls: type, name: str) -> bool:
    """Does the transformers class ``cls`` (the one :func:`adopt` mixed into) take keyword ``name`` in forward?"""
    forward: Any = cls.forward  # type: ignore[attr-defined]
    return name in inspect.signature(forward).parameters


def adopt(model: nn.Module) -> GenericCausalLM:
    """``model`` (a transformers ``PreTrainedModel``) with :class:`GenericCausalLM` mixed in, in place."""
    cls = type(model)
    if not isinstance(model, GenericCausalLM):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (GenericCausalLM, cls), {"__module__": __name__, "_hf_class": cls})
        model.__class__ = _CLASSES[cls]
    return model  # type: ignore[return-value]
