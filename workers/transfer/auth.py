"""The data plane's keyed MAC: who may write KV into a decode worker or tokens into a gateway's stream.

Every message on the KV links (`control`: ZeroMQ backend and the NCCL backend's control plane and
rendezvous store) and on the token stream (`workers/token_stream.py`) carries a tag over a direction
label, a sequence number and every frame of the message, header and payload alike, each with its
length (so bytes cannot move from one frame to the next). A peer without the secret can neither
forge a message nor alter one in flight.

The tag is Poly1305 under a one-time key: HMAC-SHA256(key, label | number | salt), where the key is
the cluster secret or one derived from it and the salt is 16 random bytes sent in the tag. This is the
shape of ChaCha20-Poly1305's MAC (a PRF makes each message's Poly1305 key), with HMAC as the PRF. The
random salt makes every one-time key fresh even where numbers repeat (each KV hello is number 1 under
the one hello key), which Poly1305 needs: two messages under one key give its key away. Why not
HMAC-SHA256 over the bytes: it runs at ~1.5 GB/s on this project's Xeon, and made a loopback KV
transfer 0.41-0.53x as fast; OpenSSL's Poly1305 (from `cryptography`) runs at ~6.6 GB/s here
(docs/security-data-plane.md has the measurements).

Replay. A KV link authenticates per connection: the sender's hello carries a fresh random nonce, the
receiver's answer another, and every later message in either direction is keyed by
`session_key(secret, sender nonce, receiver nonce)` and numbered; a receiver takes only numbers above
the last it took (`SeqWindow`). So a message recorded on one connection is refused on every other one
(another key), and on its own connection (an old number). The token stream has no back channel: its
batches are keyed by the secret and bound to the gateway's address, and the gateway takes from each
publisher (its worker id names one publisher's life) only batch numbers above the last it took.

`ClusterSecret` holds the key: made at startup or given (`PDSERVE_CLUSTER_SECRET`, a file), handed to
workers as a constructor argument; its repr never shows it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.poly1305 import Poly1305

log = logging.getLogger(__name__)

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16
SALT_BYTES = 16  # of a tag: fresh randomness for its one-time key
TAG_BYTES = SALT_BYTES + 16  # [salt | Poly1305 tag]
NONCE_BYTES = 16
_SEQ = struct.Struct("<Q")
_LEN = struct.Struct("<Q")
AUTH_FRAME_BYTES = _SEQ.size + TAG_BYTES  # [seq (8, little-endian) | salt (16) | Poly1305 (16)]
_DIGEST = "sha256"

# Direction and purpose labels: a tag made for one never checks as another (a message reflected back to
# its sender, a hello replayed as data, a store request as a KV message).
KV_HELLO = b"pdserve/kv/hello"
KV_TO_RECEIVER = b"pdserve/kv/s>r"
KV_TO_SENDER = b"pdserve/kv/r>s"
STORE_REQUEST = b"pdserve/nccl-store/req"
STORE_REPLY = b"pdserve/nccl-store/rep"
TOKENS = b"pdserve/tokens"
INBOX = b"pdserve/inbox"


class ClusterSecret:
    """The key every worker and the gateway share. Never logged: its repr and str are redacted."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"cluster secret: need at least {MIN_SECRET_BYTES} bytes")
        self._key = key

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_text(cls, text: str) -> ClusterSecret:
        """A secret as written in an environment variable or a file: 64 hex digits (`openssl rand
        -hex 32`), else the text's UTF-8 bytes (at least 16)."""
        text = text.strip()
        try:
            key = bytes.fromhex(text) if len(text) == 64 else text.encode()
        except ValueError:
            key = text.encode()
        return cls(key)

    @classmethod
    def from_file(cls, path: str) -> ClusterSecret:
        """Read a secret file; a warning (not an error) when others than its owner may read it."""
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("cluster secret file %s can be read by others than its owner (chmod 600 it)", path)
        with open(path, encoding="utf-8") as f:
            return cls.from_text(f.read())

    @classmethod
    def from_env(cls) -> ClusterSecret | None:
        text = os.environ.get(SECRET_ENV)
        try:
            return cls.from_text(text) if text else None
        except ValueError as e:  # said where the bad secret came from: the operator may have given no flag
            raise ValueError(f"{SECRET_ENV}: {e}") from None

    @classmethod
    def from_env_or_new(cls) -> ClusterSecret:
        """`PDSERVE_CLUSTER_SECRET` when set, else a new one (a cluster's startup makes it once)."""
        return cls.from_env() or cls.generate()

    def derive(self, label: bytes, *parts: bytes) -> bytes:
        """A 32-byte key for one purpose (`label`) and context (`parts`, each length-prefixed)."""
        return _hmac(self._key, label, parts)

    @property
    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(ClusterSecret)  # all equal-hashing: the key must not leak through a hash either

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:  # Ray pickles constructor arguments
        return ClusterSecret, (self._key,)


_process_secret: ClusterSecret | None = None


def default_secret() -> ClusterSecret:
    """The secret of a transport built without one: `PDSERVE_CLUSTER_SECRET` when set, else one made
    for this process (so endpoints in one process, as in tests, agree; two processes then do not)."""
    global _process_secret
    if _process_secret is None:
        _process_secret = ClusterSecret.from_env() or ClusterSecret.generate()
    return _process_secret


def set_default_secret(secret: ClusterSecret) -> None:
    """Make `secret` this process's default (a worker process: from its constructor's argument)."""
    global _process_secret
    _process_secret = secret


def resolve(secret: ClusterSecret | None) -> ClusterSecret:
    return default_secret() if secret is None else secret


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def session_key(secret: ClusterSecret, sender_nonce: str, receiver_nonce: str) -> bytes:
    """The key of one KV connection: fresh on both sides' randomness, so nothing recorded elsewhere checks."""
    return secret.derive(b"pdserve/kv/session", sender_nonce.encode(), receiver_nonce.encode())


def _bytes_of(frame: Any) -> memoryview:
    view = memoryview(frame)
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _hmac(key: bytes, label: bytes, parts: Iterable[Any]) -> bytes:
    """HMAC-SHA256 over the label and each part, length-prefixed: key derivation (deterministic)."""
    mac = hmac.new(key, _LEN.pack(len(label)) + label, _DIGEST)
    for part in parts:
        view = _bytes_of(part)
        mac.update(_LEN.pack(view.nbytes))
        mac.update(view)
    return mac.digest()


def _tag(key: bytes, label: bytes, seq: int, frames: Iterable[Any], salt: bytes | None = None) -> bytes:
    """`salt | Poly1305(one-time key, frames)`; a new random salt unless checking one (`salt`)."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    mac = Poly1305(_hmac(key, label, (_SEQ.pack(seq), salt)))
    for frame in frames:
        view = _bytes_of(frame)
        mac.update(_LEN.pack(view.nbytes))
        mac.update(view)
    return salt + mac.finalize()


def _tag_checks(key: bytes, label: bytes, seq: int, frames: Iterable[Any], claimed: bytes) -> bool:
    return len(claimed) == TAG_BYTES and hmac.compare_digest(
        claimed, _tag(key, label, seq, frames, salt=claimed[:SALT_BYTES]))


def seal(key: bytes, label: bytes, seq: int, frames: Sequence[Any]) -> bytes:
    """The auth frame of a message whose frames are `frames` (any buffers): its number and tag."""
    return _SEQ.pack(seq) + _tag(key, label, seq, frames)


def open_seq(auth: Any) -> int | None:
    """The number an auth frame claims (not yet checked), or None if it is not an auth frame."""
    view = memoryview(auth)
    if view.nbytes != AUTH_FRAME_BYTES:
        return None
    return int(_SEQ.unpack_from(view)[0])


def check(key: bytes, label: bytes, auth: Any, frames: Sequence[Any]) -> int | None:
    """The message's number if `auth` is its right tag under `key`; None otherwise (constant-time compare)."""
    seq = open_seq(auth)
    if seq is None:
        return None
    return seq if _tag_checks(key, label, seq, frames, bytes(memoryview(auth)[_SEQ.size :])) else None


def token_tag(secret: ClusterSecret, address: str, body: Any) -> bytes:
    """A token-stream batch's tag: bound to the gateway stream it is for."""
    return _tag(secret.key, TOKENS, 0, (address.encode(), body))


def token_check(secret: ClusterSecret, address: str, tag: Any, body: Any) -> bool:
    return _tag_checks(secret.key, TOKENS, 0, (address.encode(), body), bytes(memoryview(tag)))


def inbox_tag(secret: ClusterSecret, address: str, body: Any) -> bytes:
    """A worker inbox message's tag (cluster/worker_inbox.py): bound to the inbox it is for. Its
    sender and number are in `body`: the inbox takes each sender's numbers rising only."""
    return _tag(secret.key, INBOX, 0, (address.encode(), body))


def inbox_check(secret: ClusterSecret, address: str, tag: Any, body: Any) -> bool:
    return _tag_checks(secret.key, INBOX, 0, (address.encode(), body), bytes(memoryview(tag)))


class SeqWindow:
    """A receiver's replay check for one sender: numbers must rise (gaps are fine: a message the
    sender failed to send took no number's turn here)."""

    __slots__ = ("last",)

    def __init__(self, last: int = 0) -> None:
        self.last = last

    def fresh(self, seq: int) -> bool:
        return seq > self.last

    def take(self, seq: int) -> None:
        self.last = max(self.last, seq)


@dataclass
class RefusalCounts:
    """What a receiving endpoint refused from its peers (one thread writes; others read ints)."""

    forged: int = 0  # no auth frame, or a tag that does not check (no secret, another secret, altered bytes)
    replayed: int = 0  # a tag that checks, on a number already taken
    wrong_model: int = 0  # hellos from a sender running another model (fingerprint)
    dropped: int = 0  # connections the socket lost (libzmq drops one that sends a frame over its size limit)

    def add(self, other: RefusalCounts) -> RefusalCounts:
        return RefusalCounts(self.forged + other.forged, self.replayed + other.replayed,
                             self.wrong_model + other.wrong_model, self.dropped + other.dropped)


def fingerprint_digest(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(_LEN.pack(len(p)) + p for p in parts)).hexdigest()[:32]


__all__ = ["AUTH_FRAME_BYTES", "SECRET_ENV", "ClusterSecret", "RefusalCounts", "SeqWindow", "check", "default_secret",
           "new_nonce", "open_seq", "resolve", "seal", "session_key", "set_default_secret", "token_check", "token_tag"]
