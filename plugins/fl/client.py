"""The client side of a round, over any channel (gRPC or in-process): receive the global weights, hand back an
update (plain), or take part in the SecAgg+ stages (secure). Training itself is the caller's (:mod:`.training`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from crosstrain.plugins.fl.framing import TransportError
from crosstrain.plugins.fl.rounds import TRAIN


class Channel(Protocol):
    def next(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]: ...

    def reply(self, header: dict[str, Any], payload: bytes = b"") -> None: ...

    def close(self) -> None: ...


@dataclass
class Round:
    """A round this client was selected for: the global weights and the server's settings for it."""

    round: int
    stage_seq: int
    global_vec: np.ndarray
    meta: dict[str, Any]


class FLClient:
    """``next_round()`` for the first global model, then ``exchange(round, update, ...)`` after each local phase."""

    def __init__(self, channel: Channel, join_timeout_s: float = 120.0) -> None:
        self.channel = channel
        self.join_timeout_s = join_timeout_s
        self.client_id: int | None = None
        self.stage_seq = 0
        # message counter the server checks grows: start from the clock, so a restarted client continues upwards
        self.seq = time.time_ns()
        self.rng = np.random.default_rng()  # DP noise from OS entropy: a guessable seed would undo it
        self._pending: tuple[dict[str, Any], bytes] | None = None
        self.dropped_rounds: list[int] = []  # rounds whose update did not reach the server

    def _poll(self) -> tuple[dict[str, Any], bytes]:
        """The next stage addressed to this client (or ``done``); retries while the server is not reachable."""
        if self._pending is not None:
            got, self._pending = self._pending, None
            return got
        from crosstrain.plugins.fl.grpc_transport import Unreachable

        deadline = time.monotonic() + self.join_timeout_s
        while True:
            try:
                header, payload = self.channel.next({"stage_seq": self.stage_seq})
            except Unreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            self.client_id = header.get("client", self.client_id)
            if header["stage"] != "wait":
                if "stage_seq" in header:
                    self.stage_seq = int(header["stage_seq"])
                return header, payload
            deadline = time.monotonic() + self.join_timeout_s  # reachable: keep waiting for the server's round

    def _reply(self, request: dict[str, Any], fields: dict[str, Any], payload: bytes = b"") -> None:
        self.seq += 1
        self.channel.reply({"round": request["round"], "stage": request["stage"], "stage_seq": request["stage_seq"],
                            "seq": self.seq, "client": self.client_id, **fields}, payload)

    def next_round(self) -> Round | None:
        """Wait for the next round this client takes part in; None when the server has finished."""
        while True:
            header, payload = self._poll()
            if header["stage"] == "done":
                return None
            if header["stage"] == TRAIN:
                vec = np.frombuffer(payload, dtype=np.float32).copy()
                if vec.shape[0] != header["dim"]:
                    raise TransportError(f"global model of {vec.shape[0]} values, header says {header['dim']}")
                return Round(int(header["round"]), int(header["stage_seq"]), vec, header)
            # a protocol stage of a round this client has no part in any more (it was dropped): skip it

    def exchange(self, rnd: Round, update: np.ndarray, weight: float, loss: float) -> Round | None:
        """Hand back ``update`` (local - global) for ``rnd``; returns the next round (None when finished)."""
        update, weight = self.prepare(rnd, np.asarray(update, dtype=np.float32), weight)
        request = {"round": rnd.round, "stage": TRAIN, "stage_seq": rnd.stage_seq}
        fields = self.report(rnd, update, weight, loss)
        try:
            if not rnd.meta.get("secure"):
                self._reply(request, fields, update.tobytes())
            else:
                self._reply(request, fields)
                self._secure(rnd, update, weight)
        except (TransportError, ValueError) as exc:  # a closed stage, or a request the protocol rejected
            # (secagg.ProtocolError is a ValueError): this client is a dropout for the round, not a crash
            self.dropped_rounds.append(rnd.round + 1)
            print(f"fl client {self.client_id}: round {rnd.round + 1} not counted: {exc}", flush=True)
        return self.next_round()

    def prepare(self, rnd: Round, update: np.ndarray, weight: float) -> tuple[np.ndarray, float]:
        """The update and weight to send: clipped to the round's ``clip_norm``, then its DP settings: clip to
        ``dp_clip`` and, in distributed mode, this client's share of the noise, N(0, (z * C)^2 / n) for n selected
        clients, so the sum carries std z * C. A non-finite update goes as it is: the server refuses it."""
        meta = rnd.meta
        if not np.isfinite(update).all():
            return update, weight
        from crosstrain.plugins.fl.dp import add_gaussian_noise, clip_update

        if meta.get("clip_norm", 0) > 0:
            update, _ = clip_update(update, float(meta["clip_norm"]))
        if meta.get("dp_clip", 0) > 0:
            update, _ = clip_update(update, float(meta["dp_clip"]))
            weight = 1.0  # the Gaussian mechanism's sensitivity assumes unit weights
            if meta.get("dp_noise", 0) > 0:
                std = float(meta["dp_noise"]) * float(meta["dp_clip"]) / np.sqrt(float(meta["selected"]))
                update = add_gaussian_noise(update, std, self.rng)
        return np.asarray(update, dtype=np.float32), weight

    def report(self, rnd: Round, update: np.ndarray, weight: float, loss: float) -> dict[str, Any]:
        """The scalars the ``train`` reply carries: the server plans SecAgg+ from ``norm`` and bounds the
        aggregate by it (:func:`.robust.secure_mean_bound`)."""
        return {"weight": float(weight), "loss": float(loss), "norm": float(np.linalg.norm(update))}

    def _secure(self, rnd: Round, update: np.ndarray, weight: float) -> None:
        from crosstrain.plugins.fl.secagg import STAGES, ClientSession, SecAggParams

        session: Any = None
        while True:
            header, payload = self._poll()
            if header["stage"] not in STAGES or header["round"] != rnd.round:
                self._pending = (header, payload)  # the next round (or done): next_round picks it up
                return
            if session is None:
                params = SecAggParams(**header["params"])
                assert self.client_id is not None
                session = ClientSession(int(self.client_id), rnd.round, params, update, weight)
            self._reply(header, {}, session.respond(header["stage"], payload))
            if header["stage"] == STAGES[-1]:
                return
