"""Checkpoint interface and the core's local-filesystem implementation."""

from crosstrain.checkpoint.interface import Checkpointer, SaveHandle
from crosstrain.checkpoint.local import LocalCheckpointer

__all__ = ["Checkpointer", "LocalCheckpointer", "SaveHandle"]
