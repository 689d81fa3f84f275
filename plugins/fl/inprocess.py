"""The in-process transport for simulation and tests: a client channel that calls the coordinator directly.

Same interface as :class:`.grpc_transport.GrpcChannel`; every frame is still encoded and decoded, so the
checks on round, stage, sequence and payload digest run exactly as over the network.
"""

from __future__ import annotations

from typing import Any

from crosstrain.plugins.fl import framing
from crosstrain.plugins.fl.coordinator import POLL_S, Coordinator


class InProcessChannel:
    """Client ``client``'s channel to ``coordinator`` (its id is given, as a certificate would give it)."""

    def __init__(self, coordinator: Coordinator, client: int, poll_s: float = POLL_S) -> None:
        self.coordinator = coordinator
        self.client = client
        self.poll_s = poll_s

    def next(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        got, _ = framing.decode(framing.encode(header))
        out, payload = self.coordinator.next(self.client, got, self.poll_s)
        return framing.decode(framing.encode(out, payload))

    def reply(self, header: dict[str, Any], payload: bytes = b"") -> None:
        got, body = framing.decode(framing.encode(header, payload))
        self.coordinator.reply(self.client, got, body)

    def close(self) -> None:
        pass
