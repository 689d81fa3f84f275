"""The Checkpoint interface: save and load a (possibly sharded) state tree to a storage location."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any


class SaveHandle:
    """A save in progress. ``wait()`` blocks until it is durable and re-raises a background error."""

    def wait(self) -> None:  # pragma: no cover - trivial default
        return None

    def done(self) -> bool:
        return True


class Checkpointer(ABC):
    """Saves and loads a state tree (nested dicts/lists of tensors and JSON scalars).

    In a distributed job every rank calls :meth:`save` and :meth:`load` with its own shard of the state
    (plain tensors, or DTensors for sharded implementations). Implementations must never execute
    pickled code on load, and must leave ``path`` either complete or absent after a crash.
    """

    @abstractmethod
    def save(self, state: Mapping[str, Any], path: str | os.PathLike[str], *, async_save: bool = False) -> SaveHandle:
        """Write ``state`` under ``path``. With ``async_save`` return before the bytes are on disk."""

    @abstractmethod
    def load(self, path: str | os.PathLike[str], state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Read the state under ``path``. When ``state`` is given, tensors are loaded into its layout."""

    @abstractmethod
    def exists(self, path: str | os.PathLike[str]) -> bool:
        """Whether a complete checkpoint is stored under ``path``."""
