"""The byte format of every protocol message: a fixed header, named fields, and a MAC tag over all of it.

``MAGIC | version u8 | stage u8 | round u64 | sender i64 | receiver i64 | nfields u16 | (name, data)* | mac``,
big-endian; the server is party ``-1``. The header binds a message to its round, stage and both parties, and
the GMAC tag (a key each client shares with the server for this round, see :mod:`.crypto`) covers the
header too, so a flipped byte, a message moved to another round or stage, or one re-addressed fails to verify.
The first request of a round carries no tag (there is no key yet); the first reply is tagged and carries the
request's SHA-256, so the server detects a tampered first request too (the transport's TLS is the first line of
defence). Nothing here is
ever unpickled: fields are raw bytes or small JSON documents.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from crosstrain.plugins.fl.secagg.crypto import MAC_BYTES, mac_parts, verify_mac
from crosstrain.plugins.fl.secagg.errors import ProtocolError

MAGIC = b"XTSA"
VERSION = 1
SERVER = -1
STAGES: tuple[str, ...] = ("advertise", "share", "masked", "unmask")
_HEADER = struct.Struct(">4sBBQqqH")
_FIELD = struct.Struct(">BI")


@dataclass(frozen=True)
class Message:
    stage: str
    round_id: int
    sender: int
    receiver: int
    fields: dict[str, bytes]

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.fields[name])
        except (KeyError, ValueError) as e:
            raise ProtocolError(f"{self.stage} message from {self.sender} lacks a valid {name!r} field") from e

    def raw(self, name: str) -> bytes:
        if name not in self.fields:
            raise ProtocolError(f"{self.stage} message from {self.sender} lacks the {name!r} field")
        return self.fields[name]


def encode(msg: Message, key: bytes | None) -> bytes:
    """The bytes of ``msg``, tagged (GMAC) under ``key`` unless ``key`` is None."""
    parts = [_HEADER.pack(MAGIC, VERSION, STAGES.index(msg.stage), msg.round_id, msg.sender, msg.receiver,
                          len(msg.fields))]
    for name, data in msg.fields.items():
        encoded = name.encode()
        parts += [_FIELD.pack(len(encoded), len(data)), encoded, data]
    return b"".join(parts + [mac_parts(key, parts)] if key is not None else parts)


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(data: bytes, key: bytes | None) -> Message:
    """Parse and (with ``key``) authenticate; :class:`ProtocolError` on any malformed or unauthentic byte."""
    view = memoryview(data)  # slices of a view copy nothing: a masked vector is megabytes
    body = view[:-MAC_BYTES] if key is not None else view
    if key is not None:
        if len(data) < _HEADER.size + MAC_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes is too short")
        verify_mac(key, body, view[-MAC_BYTES:])
    return peek(body, strict=True)


def peek(data: bytes | memoryview, strict: bool = False) -> Message:
    """The message without checking its tag (to learn who claims to send it); ``strict`` for a tagless body."""
    if len(data) < _HEADER.size:
        raise ProtocolError(f"message of {len(data)} bytes is too short")
    magic, version, stage, round_id, sender, receiver, count = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or stage >= len(STAGES):
        raise ProtocolError("not a crosstrain SecAgg message (bad magic, version or stage)")
    fields: dict[str, bytes] = {}
    pos = _HEADER.size
    for _ in range(count):
        if pos + _FIELD.size > len(data):
            raise ProtocolError("truncated message")
        nlen, dlen = _FIELD.unpack_from(data, pos)
        pos += _FIELD.size
        if pos + nlen + dlen > len(data):
            raise ProtocolError("truncated message")
        try:
            name = bytes(data[pos:pos + nlen]).decode()
        except UnicodeDecodeError as e:
            raise ProtocolError("malformed field name") from e
        fields[name] = bytes(data[pos + nlen:pos + nlen + dlen])
        pos += nlen + dlen
    if strict and pos != len(data):
        raise ProtocolError(f"{len(data) - pos} trailing bytes after the last field")
    return Message(STAGES[stage], round_id, sender, receiver, fields)
