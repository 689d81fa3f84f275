"""Tell a rank that failed because another rank died from the rank that died first.

When one worker of a job exits, the others fail in their next collective (gloo: "Connection reset by peer",
"Connection closed by peer"; NCCL: a ``DistNetworkError``). torchelastic reports the failure with the smallest
timestamp, but it stamps exits without an error file with the second it noticed them, so a worker that merely
lost its peer, or that the agent itself stopped with SIGTERM after the first exit, ties with the one that died
and, being rank 0, is often named as the cause. Workers that fail this way exit with :data:`EXIT_PEER_LOST`;
the launcher names the first failure that is neither a peer loss nor the agent's SIGTERM.
"""

from __future__ import annotations

import signal

#: exit code of a worker whose collective failed because a peer process went away (sysexits' EX_TEMPFAIL).
EXIT_PEER_LOST = 75

_PEER_LOSS_PHRASES = ("connection reset by peer", "connection closed by peer", "broken pipe")


def is_peer_loss(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) says a peer's connection went away."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "DistNetworkError":
            return True
        if isinstance(current, RuntimeError) and any(p in str(current).lower() for p in _PEER_LOSS_PHRASES):
            return True
        current = current.__cause__ or current.__context__
    return False


def first_cause(failures: dict[int, tuple[int, int]]) -> int:
    """The rank to blame among ``{rank: (timestamp, exit code)}``: the earliest failure of its own.

    A rank's own failure (any other exit code or signal) comes before a peer loss, which comes before an exit by
    SIGTERM (the agent stops the survivors that way); within a kind the earlier, then the lower rank, as in
    torchelastic.
    """

    def kind(code: int) -> int:
        return 2 if code == -signal.SIGTERM else 1 if code == EXIT_PEER_LOST else 0

    return min(failures, key=lambda rank: (kind(failures[rank][1]), failures[rank][0], rank))
