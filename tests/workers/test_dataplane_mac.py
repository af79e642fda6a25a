"""The data plane's tag (workers/transfer/auth.py): Poly1305 under a one-time key made by HMAC-SHA256
from the key, label, number and a random salt. Checked against an independent computation of the
same construction, and for what users rely on: any changed bit is refused, a tag made for one label,
number or key checks for no other, and two tags never share a one-time key."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.workers.transfer import auth

KEY = bytes(range(32))
FRAMES = [b"header-bytes", np.arange(1000, dtype=np.float32).reshape(10, 100), b""]


def _reference_tag(key: bytes, label: bytes, seq: int, salt: bytes, frames: list[bytes]) -> bytes:
    q = struct.Struct("<Q")
    one_time = hmac.new(key, q.pack(len(label)) + label + q.pack(8) + q.pack(seq) + q.pack(len(salt)) + salt,
                        hashlib.sha256).digest()
    data = b"".join(q.pack(len(f)) + f for f in frames)
    return salt + Poly1305.generate_tag(one_time, data)


def test_the_tag_is_poly1305_under_an_hmac_made_one_time_key() -> None:
    sealed = auth.seal(KEY, auth.KV_TO_RECEIVER, 7, FRAMES)
    assert len(sealed) == auth.AUTH_FRAME_BYTES and auth.open_seq(sealed) == 7
    salt = sealed[8:8 + auth.SALT_BYTES]
    assert sealed[8:] == _reference_tag(KEY, auth.KV_TO_RECEIVER, 7, salt, [bytes(memoryview(f).cast("B"))
                                                                          for f in FRAMES])
    assert auth.check(KEY, auth.KV_TO_RECEIVER, sealed, FRAMES) == 7


def test_every_changed_bit_label_number_or_key_is_refused() -> None:
    sealed = auth.seal(KEY, auth.KV_TO_RECEIVER, 3, FRAMES)
    for i in range(len(sealed)):  # number, salt, tag: every byte
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        assert auth.check(KEY, auth.KV_TO_RECEIVER, bytes(bad), FRAMES) is None, i
    moved = [b"header-byte", b"s" + bytes(memoryview(FRAMES[1]).cast("B")), b""]  # a byte across frames
    assert auth.check(KEY, auth.KV_TO_RECEIVER, sealed, moved) is None
    payload = np.array(FRAMES[1])
    payload[5, 5] = np.nextafter(payload[5, 5], np.float32(np.inf))
    assert auth.check(KEY, auth.KV_TO_RECEIVER, sealed, [FRAMES[0], payload, b""]) is None
    assert auth.check(KEY, auth.KV_TO_SENDER, sealed, FRAMES) is None  # reflected back to its sender
    assert auth.check(os.urandom(32), auth.KV_TO_RECEIVER, sealed, FRAMES) is None
    assert auth.check(KEY, auth.KV_TO_RECEIVER, sealed[:-1], FRAMES) is None


@pytest.mark.parametrize("seq", [0, 1])
def test_one_number_reused_still_gets_a_fresh_one_time_key(seq: int) -> None:
    """Hellos are all number 1 under the hello key, token batches number 0: the salt keeps Poly1305's
    keys apart (a reused one-time key would give it away), so equal messages get unequal tags."""
    tags = {auth.seal(KEY, auth.KV_HELLO, seq, [b"same hello"]) for _ in range(64)}
    assert len(tags) == 64 and len({t[8:8 + auth.SALT_BYTES] for t in tags}) == 64
    assert all(auth.check(KEY, auth.KV_HELLO, t, [b"same hello"]) == seq for t in tags)


def test_token_tags_are_bound_to_the_stream_and_key() -> None:
    secret = auth.ClusterSecret(KEY)
    tag = auth.token_tag(secret, "tcp://127.0.0.1:5000", b"batch")
    assert len(tag) == auth.TAG_BYTES and auth.token_check(secret, "tcp://127.0.0.1:5000", tag, b"batch")
    assert not auth.token_check(secret, "tcp://127.0.0.1:5001", tag, b"batch")
    assert not auth.token_check(secret, "tcp://127.0.0.1:5000", tag, b"batcH")
    assert not auth.token_check(auth.ClusterSecret.generate(), "tcp://127.0.0.1:5000", tag, b"batch")


def test_derived_keys_are_deterministic_and_apart() -> None:
    secret = auth.ClusterSecret(KEY)
    assert secret.derive(b"a", b"x") == secret.derive(b"a", b"x")
    assert len({secret.derive(b"a", b"x"), secret.derive(b"a", b"y"), secret.derive(b"b", b"x"),
                secret.derive(b"a", b"x", b""), auth.ClusterSecret(KEY[::-1]).derive(b"a", b"x")}) == 5
