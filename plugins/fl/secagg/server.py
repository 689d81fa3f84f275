"""The server's side of a SecAgg+ round: it routes public keys and ciphertexts, sums masked vectors, and at the
end rebuilds from t shares each survivor's self-mask seed and each dropped client's mask key to strip the masks
(Bonawitz et al. 2017, figure 4; Bell et al. 2020). It never holds an individual vector in the clear: masked
vectors are added into one running sum as they arrive.

Live sets, as in the paper: ``U1`` advertised, ``U2`` shared (their pairwise masks are in the sum), ``U3`` sent
a masked vector (the survivors, whose updates are averaged), ``U4`` answered the unmask request. A client whose
secret must be rebuilt (every survivor, and every dropped client of ``U2`` with a surviving neighbour) needs at
least ``t`` live neighbours; when one has fewer the round raises :class:`SecAggAbort` naming it.
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
from dataclasses import dataclass, field

import numpy as np

from crosstrain.plugins.fl.secagg import crypto, graph, shamir, wire
from crosstrain.plugins.fl.secagg.client import MASK_KEY, SERVER_KEY, b64, id_map, unb64
from crosstrain.plugins.fl.secagg.errors import ProtocolError, SecAggAbort
from crosstrain.plugins.fl.secagg.params import SecAggParams
from crosstrain.plugins.fl.secagg.quantise import EXTRA_WORDS, dequantise


@dataclass
class AggregateResult:
    """The round's outcome: the weighted FedAvg mean of the survivors (dequantised) and what happened."""

    mean: np.ndarray
    total_weight: float
    survivors: list[int]
    dropped: list[int]
    stats: dict[str, int] = field(default_factory=dict)


class ServerSession:
    """The server in one round. Per stage: send :meth:`requests`, :meth:`accept` the replies that arrive before
    the deadline, then :meth:`close_stage` (the silent clients become dropouts). :meth:`result` after unmask."""

    def __init__(self, round_id: int, params: SecAggParams, client_ids: list[int]) -> None:
        client_ids = [operator.index(c) for c in client_ids]
        if len(client_ids) != params.num_clients or len(set(client_ids)) != len(client_ids):
            raise ValueError(f"ServerSession needs {params.num_clients} distinct client ids, got {client_ids}")
        if round_id < 0 or any(c < 0 for c in client_ids):
            raise ValueError("round and client ids must be non-negative integers")
        self.round_id, self.params = round_id, params
        self.client_ids = sorted(client_ids)
        self.graph = graph.neighbours(round_id, self.client_ids, params.neighbours)
        self._x = {c: i + 1 for i, c in enumerate(self.client_ids)}
        self._key = crypto.new_key()
        self._stage = 0
        self._live: set[int] = set(self.client_ids)
        self._replies: dict[int, dict[str, bytes]] = {}  # this stage's accepted fields, per client
        self._mac: dict[int, bytes] = {}
        self._pks: dict[int, tuple[bytes, bytes]] = {}
        self._outbox: dict[int, dict[int, str]] = {}  # receiver -> sender -> sealed share (base64)
        self._shared: set[int] = set()  # U2
        self._survivors: set[int] = set()  # U3
        self._sum: np.ndarray | None = None
        self._b_shares: dict[int, dict[int, int]] = {}
        self._sk_shares: dict[int, dict[int, int]] = {}
        self._result: AggregateResult | None = None
        self._lock = threading.RLock()  # a gRPC server calls accept from a thread pool

    # -- the stage machine ----------------------------------------------------------------------------------------
    def _at(self, stage: str) -> None:
        if stage not in wire.STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(wire.STAGES)}")
        current = wire.STAGES[self._stage] if self._stage < len(wire.STAGES) else "done"
        if stage != current:
            raise ProtocolError(f"round {self.round_id} is at stage {current!r}, not {stage!r}")

    def requests(self, stage: str) -> dict[int, bytes]:
        """What to send each live client at ``stage``."""
        with self._lock:
            return self._requests(stage)

    def accept(self, stage: str, client_id: int, reply: bytes) -> None:
        """Take one client's reply; :class:`ProtocolError` (and nothing recorded) when it is not genuine.
        Safe to call from several transport threads at once."""
        with self._lock:
            self._accept(stage, client_id, reply)

    def close_stage(self, stage: str) -> None:
        """End ``stage``: clients that did not reply are dropped; :class:`SecAggAbort` if the round cannot finish."""
        with self._lock:
            self._at(stage)
            replies, self._replies = self._replies, {}
            self._live = set(replies)
            self._stage += 1  # even when it aborts: a closed stage accepts nothing more
            getattr(self, "_close_" + stage)(replies)

    def _requests(self, stage: str) -> dict[int, bytes]:
        self._at(stage)
        out = {}
        for c in sorted(self._live):
            fields = getattr(self, "_request_" + stage)(c)
            msg = wire.Message(stage, self.round_id, wire.SERVER, c, fields)
            out[c] = wire.encode(msg, self._mac.get(c))
        return out

    def _accept(self, stage: str, client_id: int, reply: bytes) -> None:
        self._at(stage)
        if client_id not in self._live:
            raise ProtocolError(f"client {client_id} is not live in round {self.round_id} (unknown or dropped)")
        if client_id in self._replies:
            raise ProtocolError(f"client {client_id} already replied at stage {stage!r} (replay)")
        if stage == "advertise":  # the tag key comes from the reply's own c_pk
            c_pk = wire.peek(reply[:-crypto.MAC_BYTES]).raw("c_pk")
            key = crypto.agree(self._key, c_pk, SERVER_KEY, self.round_id)
        else:
            key = self._mac[client_id]
        msg = wire.decode(reply, key)
        if (msg.stage, msg.round_id, msg.sender, msg.receiver) != (stage, self.round_id, client_id, wire.SERVER):
            raise ProtocolError(f"reply claims round {msg.round_id} stage {msg.stage!r} from {msg.sender}; "
                                f"expected round {self.round_id} stage {stage!r} from {client_id}")
        getattr(self, "_accept_" + stage)(client_id, msg)
        if stage == "advertise":
            self._mac[client_id] = key
        self._replies[client_id] = msg.fields

    def result(self) -> AggregateResult:
        if self._result is None:
            raise RuntimeError(f"round {self.round_id} has no result before the unmask stage closes")
        return self._result

    def _need(self, clients: set[int], holders: set[int], stage: str) -> None:
        t, s = self.params.threshold, self.params.neighbours
        for c in sorted(clients):
            live = len(self.graph[c] & holders)
            if live < t:
                raise SecAggAbort(f"round {self.round_id} aborted at {stage}: client {c} has {live} live "
                                  f"neighbours, needs t={t} (of s={s}: at most {s - t} may drop)")

    # -- advertise ------------------------------------------------------------------------------------------------
    def _request_advertise(self, c: int) -> dict[str, bytes]:
        return {"server_pk": crypto.public_bytes(self._key), "client_ids": wire.dumps(self.client_ids)}

    def _accept_advertise(self, c: int, msg: wire.Message) -> None:
        sent = wire.encode(wire.Message("advertise", self.round_id, wire.SERVER, c, self._request_advertise(c)), None)
        if msg.raw("request_sha256") != hashlib.sha256(sent).digest():
            raise ProtocolError(f"client {c} answered an advertise request that differs from the one sent (tampered)")
        c_pk, s_pk = msg.raw("c_pk"), msg.raw("s_pk")
        crypto.load_public(s_pk)
        self._pks[c] = (c_pk, s_pk)

    def _close_advertise(self, replies: dict[int, dict[str, bytes]]) -> None:
        self._need(self._live, self._live, "advertise")

    # -- share ----------------------------------------------------------------------------------------------------
    def _request_share(self, c: int) -> dict[str, bytes]:
        keys = {str(v): [b64(self._pks[v][0]), b64(self._pks[v][1])] for v in sorted(self.graph[c] & self._live)}
        return {"keys": wire.dumps(keys)}

    def _accept_share(self, c: int, msg: wire.Message) -> None:
        sealed = id_map(msg.json("shares"), "shares")
        if set(sealed) != self.graph[c] & self._live or not all(isinstance(v, str) for v in sealed.values()):
            raise ProtocolError(f"client {c} sent shares for {sorted(sealed)}, not its live neighbours")

    def _close_share(self, replies: dict[int, dict[str, bytes]]) -> None:
        self._shared = set(self._live)
        self._need(self._shared, self._shared, "share")
        self._outbox = {c: {} for c in self._shared}
        for sender, fields in replies.items():
            for receiver, text in id_map(json.loads(fields["shares"]), "shares").items():
                if receiver in self._shared:
                    self._outbox[receiver][sender] = str(text)

    # -- masked ---------------------------------------------------------------------------------------------------
    def _request_masked(self, c: int) -> dict[str, bytes]:
        return {"shares": wire.dumps({str(v): text for v, text in sorted(self._outbox[c].items())})}

    def _accept_masked(self, c: int, msg: wire.Message) -> None:
        data, itemsize = msg.raw("y"), self.params.dtype.itemsize
        if len(data) % itemsize:
            raise ProtocolError(f"client {c} sent {len(data)} bytes of masked words, not a multiple of {itemsize}")
        y = np.frombuffer(data, dtype=self.params.dtype.newbyteorder("<"))
        if self._sum is not None and y.size != self._sum.size or y.size <= EXTRA_WORDS:
            raise ProtocolError(f"client {c} sent {y.size} masked words, others "
                                f"{None if self._sum is None else self._sum.size}")
        if self.params.bits < 8 * y.itemsize and int(y.max()) >= 2**self.params.bits:
            raise ProtocolError(f"client {c} sent masked words beyond 2**{self.params.bits}")
        if self._sum is None:
            self._sum = np.zeros(y.size, dtype=self.params.dtype)
        np.add(self._sum, y, out=self._sum)
        del msg.fields["y"]  # only the running sum is kept

    def _close_masked(self, replies: dict[int, dict[str, bytes]]) -> None:
        self._survivors = set(self._live)
        if not self._survivors:
            raise SecAggAbort(f"round {self.round_id} aborted at masked: no client sent a masked vector")
        self._need(self._to_rebuild(), self._survivors, "masked")

    def _to_rebuild(self) -> set[int]:
        """Survivors (self-mask seeds) and dropped sharers with a surviving neighbour (mask keys)."""
        dropped = {d for d in self._shared - self._survivors if self.graph[d] & self._survivors}
        return self._survivors | dropped

    # -- unmask ---------------------------------------------------------------------------------------------------
    def _request_unmask(self, c: int) -> dict[str, bytes]:
        mine = self.graph[c] & self._shared
        return {"survivors": wire.dumps(sorted(mine & self._survivors)),
                "dropped": wire.dumps(sorted(mine - self._survivors))}

    def _accept_unmask(self, c: int, msg: wire.Message) -> None:
        mine = self.graph[c] & self._shared
        b, sk = id_map(msg.json("b"), "self-mask shares"), id_map(msg.json("sk"), "mask-key shares")
        if set(b) != mine & self._survivors or set(sk) != mine - self._survivors:
            raise ProtocolError(f"client {c} sent shares of {sorted(b)} and {sorted(sk)}, not the ones asked for")
        try:
            parsed_b = {v: shamir.from_bytes(unb64(text)) for v, text in b.items()}
            parsed_sk = {v: shamir.from_bytes(unb64(text)) for v, text in sk.items()}
        except ValueError as e:
            raise ProtocolError(f"client {c} sent a malformed share") from e
        for v, y in parsed_b.items():
            self._b_shares.setdefault(v, {})[self._x[c]] = y
        for v, y in parsed_sk.items():
            self._sk_shares.setdefault(v, {})[self._x[c]] = y

    def _close_unmask(self, replies: dict[int, dict[str, bytes]]) -> None:
        t = self.params.threshold
        self._need(self._to_rebuild(), self._live, "unmask")
        assert self._sum is not None
        acc, count = self._sum, self._sum.size
        masks = [(_first(self._b_shares[u], t, u).to_bytes(crypto.KEY_BYTES, "big"), False)
                 for u in sorted(self._survivors)]  # every survivor's self mask comes off
        for d in sorted(self._to_rebuild() - self._survivors):
            raw = _first(self._sk_shares[d], t, d).to_bytes(crypto.KEY_BYTES, "big")
            s_key = crypto.X25519PrivateKey.from_private_bytes(raw)
            if crypto.public_bytes(s_key) != self._pks[d][1]:
                raise ProtocolError(f"the shares of client {d}'s mask key do not rebuild its advertised key")
            # a survivor u added its mask with d if u < d, subtracted it otherwise: undo that
            masks += [(crypto.agree(s_key, self._pks[u][1], MASK_KEY, self.round_id), u > d)
                      for u in sorted(self.graph[d] & self._survivors)]
        crypto.add_masks(acc, masks)
        survivors = sorted(self._survivors)
        mean, total_weight, stats = dequantise(acc, len(survivors), self.params)
        stats.update(survivors=len(survivors), dropped=self.params.num_clients - len(survivors),
                     dim=count - EXTRA_WORDS)
        dropped = sorted(set(self.client_ids) - self._survivors)
        self._result = AggregateResult(mean, total_weight, survivors, dropped, stats)


def _first(shares: dict[int, int], t: int, owner: int) -> int:
    """The secret behind the first ``t`` shares (by x). With more than ``t`` shares the last ``t`` must agree, and
    a secret beyond 256 bits cannot be genuine: either way a client sent a wrong share."""
    ordered = sorted(shares.items())
    secret = shamir.combine(dict(ordered[:t]))
    if secret >= 2 ** (8 * crypto.KEY_BYTES) or (len(ordered) > t and shamir.combine(dict(ordered[-t:])) != secret):
        raise ProtocolError(f"the shares of client {owner}'s secret disagree: a neighbour sent a wrong share")
    return secret
