"""The server's mailbox: stages opened by the round loop, long-polled and answered by clients.

Transport-agnostic: the gRPC service (:mod:`.grpc_transport`) and the in-process transport (:mod:`.inprocess`)
both call :meth:`Coordinator.next` and :meth:`Coordinator.reply` with the client id they authenticated. A stage
is open from :meth:`open_stage` until :meth:`wait` returns (every addressed client replied, or the deadline
passed); a client that has not replied by then is a dropout. Replies are checked before they are accepted:
the round, stage and stage number must be the open ones, the sender's ``seq`` must grow, one reply per stage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from crosstrain.plugins.fl.framing import TransportError

#: how long one ``next`` long-poll waits before telling the client to ask again.
POLL_S = 10.0


class Refused(TransportError):
    """A well-formed reply whose content the round refuses (e.g. a non-finite update): counted like a rejected
    frame, and the client is out of the stage, so the stage need not wait for it to the deadline."""


@dataclass
class Stage:
    round: int
    name: str
    seq: int
    requests: dict[int, bytes]
    meta: dict[str, Any]
    validate: Callable[[int, dict[str, Any], bytes], None] | None
    replies: dict[int, tuple[dict[str, Any], bytes]] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)


class Coordinator:
    """Thread-safe state shared by the round loop (server side) and the transport handlers (client side)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._stage: Stage | None = None
        self._stage_seq = 0
        self._last_seq: dict[int, int] = {}
        self.seen: dict[int, float] = {}  # client id -> monotonic time of its last poll
        self.done = False
        self.told_done: set[int] = set()
        self.rejected = 0

    # ------------------------------------------------------------------ the round loop's side
    def open_stage(self, round_id: int, name: str, requests: dict[int, bytes], meta: dict[str, Any] | None = None,
                   validate: Callable[[int, dict[str, Any], bytes], None] | None = None) -> None:
        """Publish ``requests[client]`` for this stage; ``validate(client, header, payload)`` may reject a reply
        (raise) before it is accepted, so the client learns at once."""
        with self._cond:
            self._stage_seq += 1
            self._stage = Stage(round_id, name, self._stage_seq, dict(requests), dict(meta or {}), validate)
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> dict[int, tuple[dict[str, Any], bytes]]:
        """Block until every addressed client replied or ``timeout_s`` passed; close the stage, return replies."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            stage = self._stage
            assert stage is not None
            while len(stage.replies) + len(stage.refused) < len(stage.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._stage = None  # closed: late replies are rejected
            return dict(stage.replies)

    def connected(self, within_s: float) -> list[int]:
        """Clients that polled within the last ``within_s`` seconds."""
        now = time.monotonic()
        with self._cond:
            return sorted(c for c, t in self.seen.items() if now - t <= within_s)

    def count_refused(self, count: int) -> None:
        """Count ``count`` replies the round refused after accepting them (e.g. an outlying update norm)."""
        with self._cond:
            self.rejected += count

    def wait_for_clients(self, count: int, timeout_s: float, within_s: float = 2 * POLL_S) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            ids = self.connected(within_s)
            if len(ids) >= count or time.monotonic() >= deadline:
                return ids
            with self._cond:
                self._cond.wait(0.05)

    def finish(self) -> None:
        """No more rounds: every poll answers ``done``."""
        with self._cond:
            self.done = True
            self._stage = None
            self._cond.notify_all()

    def wait_done(self, clients: set[int], timeout_s: float) -> None:
        """After :meth:`finish`: wait (up to ``timeout_s``) until each of ``clients`` has been told ``done``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not clients <= self.told_done and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    # ------------------------------------------------------------------ the clients' side
    def next(self, client: int, header: dict[str, Any], poll_s: float = POLL_S) -> tuple[dict[str, Any], bytes]:
        """The request of the first open stage newer than ``header["stage_seq"]`` addressed to ``client``;
        ``{"stage": "wait"}`` after ``poll_s`` without one, ``{"stage": "done"}`` once the server finished."""
        after = int(header.get("stage_seq", 0))
        deadline = time.monotonic() + poll_s
        with self._cond:
            self.seen[client] = time.monotonic()
            self._cond.notify_all()
            while True:
                if self.done:
                    self.told_done.add(client)
                    self._cond.notify_all()
                    return {"stage": "done", "client": client}, b""
                stage = self._stage
                if stage is not None and stage.seq > after and client in stage.requests \
                        and client not in stage.replies:
                    return ({"round": stage.round, "stage": stage.name, "stage_seq": stage.seq, "client": client,
                             **stage.meta}, stage.requests[client])
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"stage": "wait", "client": client, "stage_seq": after}, b""
                self._cond.wait(min(left, 1.0))
                self.seen[client] = time.monotonic()

    def reply(self, client: int, header: dict[str, Any], payload: bytes) -> None:
        """Accept ``client``'s reply to the open stage, or raise TransportError naming what is wrong."""
        with self._cond:
            try:
                self._check(client, header)
                stage = self._stage
                assert stage is not None
                if stage.validate is not None:
                    stage.validate(client, header, payload)
            except Exception as exc:
                self.rejected += 1
                if isinstance(exc, Refused) and self._stage is not None:
                    self._stage.refused.add(client)
                    self._cond.notify_all()
                raise
            self._last_seq[client] = int(header["seq"])
            stage.replies[client] = (header, payload)
            self._cond.notify_all()

    def _check(self, client: int, header: dict[str, Any]) -> None:
        stage = self._stage
        seq = header.get("seq")
        if not isinstance(seq, int) or seq <= self._last_seq.get(client, -1):
            raise TransportError(f"client {client}: message seq {seq!r} is not above its last "
                                 f"({self._last_seq.get(client, -1)}): replayed")
        if stage is None:
            raise TransportError(f"client {client}: no stage is open (round {header.get('round')!r} "
                                 f"stage {header.get('stage')!r} has closed)")
        got = (header.get("round"), header.get("stage"), header.get("stage_seq"))
        if got != (stage.round, stage.name, stage.seq):
            raise TransportError(f"client {client}: reply for round/stage/number {got} but "
                                 f"{(stage.round, stage.name, stage.seq)} is open")
        if client not in stage.requests:
            raise TransportError(f"client {client} is not part of round {stage.round} stage {stage.name!r}")
        if client in stage.replies or client in stage.refused:
            raise TransportError(f"client {client} already replied to round {stage.round} stage {stage.name!r}")
