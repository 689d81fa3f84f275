"""One client's side of a SecAgg+ round (Bonawitz et al. 2017, figure 4; Bell et al. 2020, neighbourhoods).

Per round the client makes two X25519 key pairs, ``c`` (to encrypt shares) and ``s`` (pairwise masks), and a
self-mask seed ``b``. Stage by stage it answers the server:

1. advertise: ``c_pk, s_pk``.
2. share: ``b`` and ``s_sk`` split t-of-s (Shamir) among its neighbours, each pair of shares AES-GCM-encrypted
   for one neighbour under HKDF(X25519(c_sk, c_pk_v)).
3. masked: ``y = q + PRG(b) + sum_{v > u} PRG(k_uv) - sum_{v < u} PRG(k_uv)  (mod 2**bits)``, ``k_uv =
   HKDF(X25519(s_sk, s_pk_v))``, over the neighbours ``v`` whose shares it received.
4. unmask: for each neighbour the server says survived, its share of ``b_v``; for each it says dropped, its share
   of ``s_sk_v``; never both for one neighbour, so the server never rebuilds both secrets of anyone.

Every request is checked for round, stage, addressee and MAC tag before anything is revealed.

The heavy work runs on one worker thread, off the stages' critical path (numpy releases the GIL in its loops, so
it overlaps the transport's waits): quantising and the self mask ``PRG(b)`` (its seed is local) start when the
session is made, the pairwise masks as soon as the share request names the neighbours' ``s_pk``. The masked stage
then only takes out again the masks of neighbours whose shares never came (they dropped before sharing), which
Bonawitz et al.'s step 3 leaves out from the start: the sum is the same.
"""

from __future__ import annotations

import base64
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from crosstrain.plugins.fl.secagg import crypto, graph, shamir, wire
from crosstrain.plugins.fl.secagg.errors import ProtocolError
from crosstrain.plugins.fl.secagg.params import SecAggParams
from crosstrain.plugins.fl.secagg.quantise import check_update, quantise

SHARE_KEY, MASK_KEY, SERVER_KEY = b"share", b"mask", b"server"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ProtocolError("malformed base64 field")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise ProtocolError("malformed base64 field") from e


def id_map(value: object, what: str) -> dict[int, object]:
    """A JSON object keyed by client ids, with the keys back as ints."""
    if not isinstance(value, dict):
        raise ProtocolError(f"malformed {what}: expected an object keyed by client id")
    try:
        return {int(k): v for k, v in value.items()}
    except ValueError as e:
        raise ProtocolError(f"malformed {what}: a key is not a client id") from e


class ClientSession:
    """One client in one round: feed it each server request with :meth:`respond`, send back what it returns."""

    def __init__(self, client_id: int, round_id: int, params: SecAggParams, vector: np.ndarray,
                 weight: float = 1.0, rounding_seed: int | None = None) -> None:
        if client_id < 0 or round_id < 0:
            raise ValueError(f"client id {client_id} and round id {round_id} must be non-negative integers")
        self.client_id, self.round_id, self.params = client_id, round_id, params
        # bad input fails here, at once; the copy is one the caller cannot change while the worker reads it
        vector = np.array(check_update(vector, weight, params)[0])
        self._next = 0  # index into wire.STAGES of the next request this client answers
        self._c_key, self._s_key = crypto.new_key(), crypto.new_key()
        self._seed = os.urandom(crypto.KEY_BYTES)
        self._mac_key: bytes | None = None
        self._neighbours: frozenset[int] = frozenset()
        self._x: dict[int, int] = {}  # Shamir x-coordinate of every client: its position in the sorted ids + 1
        self._keys: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (c_pk, s_pk)
        self._held: dict[int, tuple[int, int]] = {}  # neighbour -> my shares of (its b, its s_sk)
        self._request = b""
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"secagg-client-{client_id}")
        self._quantised = self._worker.submit(self._quantise, vector, weight, rounding_seed)
        self._pairs: Future[None] | None = None

    @property
    def words(self) -> np.ndarray:
        """The quantised words ``[q(w x)..., q(w), clipped]`` (see :func:`.quantise.quantise`)."""
        return self._quantised.result()[0]

    @property
    def clipped(self) -> int:
        """How many of this client's coordinates were clipped (exact; the server sees only the total)."""
        return self._quantised.result()[1]

    def _quantise(self, vector: np.ndarray, weight: float, rounding_seed: int | None) -> tuple[
            np.ndarray, int, np.ndarray]:
        words, clipped = quantise(vector, weight, self.params, rounding_seed)
        y = words.copy()
        crypto.add_masks(y, [(self._seed, True)])
        return words, clipped, y

    def _pair_masks(self, neighbours: list[int], undo: bool = False) -> None:
        """``y +- PRG(k_uv)`` in place for each neighbour ``v``: added when ``u < v``, subtracted otherwise (the
        reverse when ``undo``). On the worker it runs after :meth:`_quantise` (one thread, tasks in order)."""
        y = self._quantised.result()[2]
        keys = [crypto.agree(self._s_key, self._keys[v][1], MASK_KEY, self.round_id) for v in neighbours]
        crypto.add_masks(y, [(k, (self.client_id < v) != undo) for k, v in zip(keys, neighbours, strict=True)])

    def respond(self, stage: str, request: bytes) -> bytes:
        """The reply to the server's ``stage`` request; :class:`ProtocolError` if the request is not genuine."""
        if stage not in wire.STAGES:
            raise ProtocolError(f"unknown stage {stage!r}; stages are {', '.join(wire.STAGES)}")
        expected = wire.STAGES[self._next] if self._next < len(wire.STAGES) else None
        if stage != expected:
            raise ProtocolError(f"client {self.client_id} got a {stage!r} request but expects "
                                f"{expected!r} (replayed or out of order)")
        msg = wire.decode(request, self._mac_key)
        self._request = request
        if (msg.stage, msg.round_id, msg.sender, msg.receiver) != (stage, self.round_id, wire.SERVER,
                                                                    self.client_id):
            raise ProtocolError(f"client {self.client_id} round {self.round_id} got a request for round "
                                f"{msg.round_id} stage {msg.stage!r} addressed to {msg.receiver}")
        fields = getattr(self, "_" + stage)(msg)
        self._next += 1
        reply = wire.Message(stage, self.round_id, self.client_id, wire.SERVER, fields)
        return wire.encode(reply, self._mac_key)

    def _advertise(self, msg: wire.Message) -> dict[str, bytes]:
        ids = msg.json("client_ids")
        if (not isinstance(ids, list) or len(ids) != self.params.num_clients or len(set(ids)) != len(ids)
                or self.client_id not in ids or not all(isinstance(i, int) for i in ids)):
            raise ProtocolError(f"advertise request lists {ids!r}, not {self.params.num_clients} distinct ids "
                                f"including {self.client_id}")
        self._neighbours = graph.neighbours(self.round_id, ids, self.params.neighbours)[self.client_id]
        self._x = {c: i + 1 for i, c in enumerate(sorted(ids))}
        self._mac_key = crypto.agree(self._c_key, msg.raw("server_pk"), SERVER_KEY, self.round_id)
        # the first request carries no tag; echoing its digest under the new tag lets the server detect tampering
        return {"c_pk": crypto.public_bytes(self._c_key), "s_pk": crypto.public_bytes(self._s_key),
                "request_sha256": hashlib.sha256(self._request).digest()}

    def _share(self, msg: wire.Message) -> dict[str, bytes]:
        keys = id_map(msg.json("keys"), "neighbour keys")
        if not set(keys) <= self._neighbours or len(keys) < self.params.threshold:
            raise ProtocolError(f"client {self.client_id} was sent keys of {sorted(keys)}: not at least "
                                f"t={self.params.threshold} of its neighbours {sorted(self._neighbours)}")
        for v, pair in keys.items():
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"malformed public keys of client {v}")
        self._keys = {v: (unb64(pair[0]), unb64(pair[1])) for v, pair in keys.items()}  # type: ignore[index]
        t = self.params.threshold
        xs = [self._x[v] for v in keys]
        b_shares = shamir.split(int.from_bytes(self._seed, "big"), xs, t)
        sk_shares = shamir.split(int.from_bytes(crypto.private_bytes(self._s_key), "big"), xs, t)
        sealed = {}
        for v in keys:
            key = crypto.agree(self._c_key, self._keys[v][0], SHARE_KEY, self.round_id)
            plain = shamir.to_bytes(b_shares[self._x[v]]) + shamir.to_bytes(sk_shares[self._x[v]])
            sealed[str(v)] = b64(crypto.seal(key, plain, crypto.share_aad(self.round_id, self.client_id, v)))
        # the masks of every neighbour that got keys; _masked takes out those whose shares do not arrive
        self._pairs = self._worker.submit(self._pair_masks, sorted(self._keys))
        return {"shares": wire.dumps(sealed)}

    def _masked(self, msg: wire.Message) -> dict[str, bytes]:
        sealed = id_map(msg.json("shares"), "routed shares")
        if not set(sealed) <= set(self._keys) or len(sealed) < self.params.threshold:
            raise ProtocolError(f"client {self.client_id} was routed shares from {sorted(sealed)}: not at least "
                                f"t={self.params.threshold} of the neighbours it sent keys to")
        n, held = shamir.SHARE_BYTES, {}
        for v, text in sealed.items():
            key = crypto.agree(self._c_key, self._keys[v][0], SHARE_KEY, self.round_id)
            plain = crypto.open_sealed(key, unb64(text), crypto.share_aad(self.round_id, v, self.client_id))
            if len(plain) != 2 * n:
                raise ProtocolError(f"share from client {v} has {len(plain)} bytes, not {2 * n}")
            try:
                held[v] = (shamir.from_bytes(plain[:n]), shamir.from_bytes(plain[n:]))
            except ValueError as e:
                raise ProtocolError(f"share from client {v} is not a field element") from e
        assert self._pairs is not None  # set by _share, which ran before (the stage order is checked)
        self._pairs.result()  # re-raises the worker's error here (a degenerate neighbour key)
        self._held = held
        y, dtype = self._quantised.result()[2], self.params.dtype
        self._pair_masks(sorted(set(self._keys) - set(held)), undo=True)  # dropped before sharing: not in U2
        self._worker.shutdown(wait=False)
        if self.params.bits < 8 * dtype.itemsize:
            np.bitwise_and(y, dtype.type(2**self.params.bits - 1), out=y)
        return {"y": y.astype(dtype.newbyteorder("<"), copy=False).tobytes()}

    def _unmask(self, msg: wire.Message) -> dict[str, bytes]:
        survivors, dropped = msg.json("survivors"), msg.json("dropped")
        if not (isinstance(survivors, list) and isinstance(dropped, list)
                and all(isinstance(v, int) for v in survivors + dropped)):
            raise ProtocolError("malformed unmask request: survivors and dropped must be lists of client ids")
        alive, gone = set(survivors), set(dropped)
        if alive & gone or not (alive | gone) <= set(self._held) or len(alive) + len(gone) != len(survivors) + len(
                dropped):
            raise ProtocolError(f"client {self.client_id} refuses to unmask: survivors {sorted(alive)} and "
                                f"dropped {sorted(gone)} overlap or name clients it holds no shares of")
        b = {str(v): b64(shamir.to_bytes(self._held[v][0])) for v in sorted(alive)}
        sk = {str(v): b64(shamir.to_bytes(self._held[v][1])) for v in sorted(gone)}
        return {"b": wire.dumps(b), "sk": wire.dumps(sk)}
