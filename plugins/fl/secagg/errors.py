"""The two ways a secure-aggregation round fails: it cannot complete, or a message is not what it claims."""

from __future__ import annotations

from crosstrain.errors import CrosstrainError


class SecAggAbort(CrosstrainError, RuntimeError):
    """The round cannot complete (too few live neighbours to reconstruct a secret); ``str(e)`` says who and why."""


class ProtocolError(CrosstrainError, ValueError):
    """A tampered, replayed, wrong-round, wrong-stage or malformed message; it is rejected and changes nothing."""
