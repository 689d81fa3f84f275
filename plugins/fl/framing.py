"""Wire framing of the FL transport: ``[4-byte big-endian header length][JSON header][payload bytes]``.

The header carries what the transport checks on every reply: ``round``, ``stage``, ``stage_seq`` (the server's
number of the stage being answered), ``seq`` (the sender's strictly increasing message counter) and
``sha256`` (of the payload). The protocol's own messages (SecAgg+ ciphertexts) are the opaque payload.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from crosstrain.errors import CrosstrainError

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20


class TransportError(CrosstrainError):
    """A frame was malformed, tampered with, replayed, or answers a round or stage that is not open."""

    exit_code = 6


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """One frame; ``sha256`` of the payload is added to the header."""
    head = json.dumps({**header, "sha256": hashlib.sha256(payload).hexdigest()}, separators=(",", ":")).encode()
    return _LEN.pack(len(head)) + head + payload


def decode(frame: bytes) -> tuple[dict[str, Any], bytes]:
    """``(header, payload)``; TransportError if the frame is truncated, not JSON or its payload digest differs."""
    if len(frame) < _LEN.size:
        raise TransportError(f"frame of {len(frame)} bytes is shorter than its length prefix")
    (size,) = _LEN.unpack_from(frame)
    if size > MAX_HEADER or _LEN.size + size > len(frame):
        raise TransportError(f"frame header length {size} does not fit the {len(frame)}-byte frame")
    try:
        header = json.loads(frame[_LEN.size:_LEN.size + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TransportError("frame header must be a JSON object")
    payload = frame[_LEN.size + size:]
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise TransportError("frame payload does not match its sha256 (tampered or corrupted)")
    return header, payload
