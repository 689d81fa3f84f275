"""``TokenBatch``: the batch the token datasets give a recipe (``lm`` and every recipe built on it).

A frozen dataclass rather than a tuple, so that a field added later (the document ids of ``data.packing =
"documents"``) cannot be dropped by a recipe that unpacks ``inputs, targets = batch``: unpacking or indexing one
is a ``TypeError`` that names the fields to read instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import torch

_NOT_A_TUPLE = ("a TokenBatch is not a tuple: read batch.inputs, batch.targets and, with data.packing='documents', "
                "batch.document_ids / batch.positions (docs/recipes.md, Batches)")


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field by field is ambiguous
class TokenBatch:
    """Next-token training rows, every tensor int64 ``[B, T]``.

    ``inputs``: token ids; ``targets``: the next token of each input (``inputs`` shifted by one). With
    ``data.packing = "documents"`` (:mod:`crosstrain.data.packing`) also ``document_ids``: the document of each
    input token, numbered from 0 in each row (pass them to the GPT as ``doc_ids`` so attention stays inside a
    document), and ``positions``: each token's position inside its document as the GPT counts it (0 at a
    document's first token and at the row's first token); both are None without packing.
    :func:`crosstrain.engine.step.to_device` moves every field.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    # a tuple-like use would silently keep only the fields it names; refuse it with the fix
    def __iter__(self) -> NoReturn:
        raise TypeError(_NOT_A_TUPLE)

    def __getitem__(self, key: Any) -> NoReturn:
        raise TypeError(_NOT_A_TUPLE)
