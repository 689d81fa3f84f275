"""Every cryptographic primitive the protocol uses, all from ``cryptography`` (Bonawitz et al. 2017, section 3).

- key agreement: X25519, then HKDF-SHA256 with a label naming the use and the round, so one Diffie-Hellman
  secret never keys two things and no key outlives its round;
- share encryption: AES-256-GCM with associated data (round, stage, sender, receiver), so a ciphertext that is
  altered, replayed into another round or re-addressed fails to open;
- message authentication between each client and the server: GMAC (AES-GCM over associated data only);
- mask expansion: AES-256-CTR keystream from the full 256-bit seed, read as little-endian words (a PRG).
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crosstrain.plugins.fl.secagg.errors import ProtocolError

KEY_BYTES = 32
NONCE_BYTES = 12
MAC_BYTES = NONCE_BYTES + 16  # nonce and GCM tag
_GMAC_LIMIT = 2**31 - 1
_MASK_BLOCK_BYTES = 1 << 18  # 256 KiB of words per pass of add_masks: fits in L2


def new_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def load_public(data: bytes) -> X25519PublicKey:
    try:
        return X25519PublicKey.from_public_bytes(data)
    except ValueError as e:
        raise ProtocolError(f"malformed X25519 public key ({len(data)} bytes)") from e


def agree(mine: X25519PrivateKey, theirs: bytes, label: bytes, round_id: int) -> bytes:
    """A 32-byte key for ``label`` in this round: HKDF-SHA256(X25519(mine, theirs)) (RFC 7748, RFC 5869)."""
    try:
        shared = mine.exchange(load_public(theirs))
    except ValueError as e:  # an all-zero (low-order) shared secret
        raise ProtocolError("X25519 key agreement failed: the peer's public key is degenerate") from e
    info = b"crosstrain-secagg/" + label + struct.pack(">Q", round_id)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def share_aad(round_id: int, sender: int, receiver: int) -> bytes:
    return b"crosstrain-secagg/share" + struct.pack(">Qqq", round_id, sender, receiver)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``nonce || AES-GCM(key, nonce, plaintext, aad)`` with a fresh random 96-bit nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`; :class:`ProtocolError` when the ciphertext or its binding was altered."""
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError) as e:
        raise ProtocolError("share ciphertext failed authentication (tampered, replayed or misaddressed)") from e


def _gmac_input(data: bytes | memoryview) -> bytes | memoryview:
    # AESGCM takes at most 2**31 - 1 bytes of associated data; a longer message is tagged through its SHA-256
    return data if len(data) < _GMAC_LIMIT else hashlib.sha256(data).digest()


def mac_parts(key: bytes, parts: list[bytes]) -> bytes:
    """``nonce || GMAC(key, nonce, data)`` of ``data = b"".join(parts)``: AES-GCM over an empty plaintext with
    ``data`` as associated data (NIST SP 800-38D's GMAC), with a fresh random 96-bit nonce. Chosen over HMAC-SHA256,
    which is ~4x slower on the megabytes of a masked vector. The parts are never joined (GCM takes its associated
    data piece by piece), so a message of megabytes is tagged without one more copy of it."""
    if sum(len(p) for p in parts) >= _GMAC_LIMIT:  # tagged through its SHA-256, as _gmac_input does
        digest = hashlib.sha256()
        for p in parts:
            digest.update(p)
        parts = [digest.digest()]
    nonce = os.urandom(NONCE_BYTES)
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    for p in parts:
        encryptor.authenticate_additional_data(p)
    encryptor.finalize()
    return nonce + encryptor.tag


def verify_mac(key: bytes, data: bytes | memoryview, tag: bytes | memoryview) -> None:
    try:
        AESGCM(key).decrypt(tag[:NONCE_BYTES], tag[NONCE_BYTES:], _gmac_input(data))
    except (InvalidTag, ValueError) as e:
        raise ProtocolError("message authentication failed (tampered, replayed or from another round)") from e


def prg(seed: bytes, count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` pseudorandom words of ``dtype`` (uint32/uint64): the AES-256-CTR keystream under ``seed``.

    The key is the whole 256-bit seed and the counter starts at zero; a seed is never reused (each is fresh or
    HKDF-derived per round), so the stream is a PRG in the sense Bonawitz et al. 2017 need.
    """
    nbytes = count * np.dtype(dtype).itemsize
    out = np.empty(nbytes + 15, dtype=np.uint8)  # update_into wants room for one more block
    _stream(seed).update_into(_zeros(nbytes), out.data)
    return out[:nbytes].view(np.dtype(dtype).newbyteorder("<"))


def add_masks(acc: np.ndarray, masks: list[tuple[bytes, bool]]) -> None:
    """``acc += PRG(seed)`` (or ``-=`` where the flag is False) for every ``(seed, add)``, in place, wrapping mod
    the word size: the same words as :func:`prg`, expanded block by block so that a block of ``acc`` stays in
    cache while every stream is added to it (each stream is one AES-CTR encryptor, advanced block by block)."""
    streams = [(_stream(seed), np.add if add else np.subtract) for seed, add in masks]
    words = acc.reshape(-1)
    if not streams or not words.size:
        return
    block = min(_MASK_BLOCK_BYTES // words.itemsize, words.size)
    scratch = np.empty(block * words.itemsize + 15, dtype=np.uint8)
    for start in range(0, words.size, block):
        part = words[start:start + block]
        plain = _zeros(part.nbytes)
        for stream, op in streams:
            stream.update_into(plain, scratch.data)
            op(part, scratch[:part.nbytes].view(words.dtype.newbyteorder("<")), out=part)


def _stream(seed: bytes) -> Any:
    if len(seed) != KEY_BYTES:
        raise ValueError("a mask seed is 32 bytes")
    return Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    """The all-zero plaintext whose encryption is the keystream (cached: a round expands many same-size masks)."""
    return bytes(nbytes)
