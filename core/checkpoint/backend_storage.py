"""The checkpointer a :class:`~crosstrain.checkpoint.manager.CheckpointManager` writes and reads through.

It comes from the backend (``Backend.checkpointer()``), so a backend can put the bytes elsewhere by returning a
:class:`DCPCheckpointer` subclass with its own storage writer/reader. The commit protocol (temporary folder,
manifest of SHA-256s, atomic rename) stays the core's: it is what makes resume and verification safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crosstrain.checkpoint.dcp import DCPCheckpointer
from crosstrain.errors import PluginError

if TYPE_CHECKING:
    from crosstrain.backend import Backend


def backend_checkpointer(backend: Backend | None, process_group: Any, *, thread_count: int = 1) -> DCPCheckpointer:
    """``backend.checkpointer()`` (default: the active backend's), bound to ``process_group``."""
    if backend is None:
        from crosstrain.registry import active_backend

        backend = active_backend()
    checkpointer = backend.checkpointer()
    if not isinstance(checkpointer, DCPCheckpointer):
        raise PluginError(f"backend {backend.name!r}: checkpointer() returned a {type(checkpointer).__name__}, but "
                          "trainer checkpoints need a crosstrain.checkpoint.dcp.DCPCheckpointer; return a subclass "
                          "that sets writer_factory/reader_factory instead")
    checkpointer.group = process_group
    checkpointer.thread_count = thread_count
    return checkpointer
