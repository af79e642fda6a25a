"""The rendezvous store of the NCCL/gloo KV transport (see `nccl_backend`): a `torch.distributed.Store`
whose keys live in the receiver's process and are served on its ROUTER.

The receiver's rank sees the keys through `LocalStore`, a sender's rank through `StoreClient` (a DEALER
of its own, asking the receiver's ROUTER with `STORE_MAGIC`-tagged requests). c10d calls these Python
stores through its `PythonStore` trampoline. Bounded, since it is served to the network.

Requests and replies are authenticated (`auth`): a request carries a numbered HMAC tag under a key
derived from the cluster secret, which the receiver checks (numbers rising per store connection); the
reply's tag is bound to the request's, so it answers only that request.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist
import zmq

from pdserve.workers.link_monitor import SMALL_FRAME_BYTES, apply_limits
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

STORE_MAGIC = b"pdserve-kv-store/1"  # first frame of a store request or reply (never a msgpack message)
_STORE_POLL_S = 0.005  # a remote get/wait asks again this often (backing off to 10x) until the key is there
_STORE_MAX_KEYS = 4096
_STORE_MAX_BYTES = 1 << 16  # per key and per value


class StoreTable:
    """The receiver's store: keys to bytes, with waits. Thread-safe; bounded (it is served to the network)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._check(key, value)
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout_s)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self.set(key, str(value).encode())
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self.set(key, desired)
                return desired
            return current if current is not None else expected

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def drop_prefix(self, prefix: str) -> None:
        with self._cond:
            for key in [k for k in self._data if k.startswith(prefix)]:
                del self._data[key]

    def __len__(self) -> int:
        with self._cond:
            return len(self._data)

    def serve(self, op: bytes, key: bytes, value: bytes, extra: bytes) -> list[bytes]:
        """One remote request -> [status, value] (never blocks: a remote get of a missing key is asked again)."""
        try:
            name = key.decode()
            if op == b"set":
                self.set(name, value)
                return [b"ok", b""]
            if op == b"get":
                found = self.get(name)
                return [b"ok", found] if found is not None else [b"missing", b""]
            if op == b"add":
                return [b"ok", str(self.add(name, int(value))).encode()]
            if op == b"compare_set":
                return [b"ok", self.compare_set(name, value, extra)]
            if op == b"delete":
                return [b"ok", b"1" if self.delete(name) else b"0"]
            if op == b"num_keys":
                return [b"ok", str(len(self)).encode()]
            raise ValueError(f"unknown store operation {op[:32]!r}")
        except (ValueError, UnicodeDecodeError) as e:
            return [b"error", str(e).encode()[:200]]

    def _check(self, key: str, value: bytes) -> None:
        if len(key) > _STORE_MAX_BYTES or len(value) > _STORE_MAX_BYTES:
            raise ValueError("store key or value too large")
        if key not in self._data and len(self._data) >= _STORE_MAX_KEYS:
            raise ValueError(f"store full ({_STORE_MAX_KEYS} keys)")


def _seconds(timeout: datetime.timedelta | None, default_s: float) -> float:
    return default_s if timeout is None else timeout.total_seconds()


class LocalStore(dist.Store):  # type: ignore[misc,name-defined]  # c10d's Store has no stubs
    """c10d's view of the receiver's `StoreTable`, for the receiver's own rank (rank 0)."""

    def __init__(self, table: StoreTable, timeout_s: float) -> None:
        super().__init__()
        self._table, self._timeout_s = table, timeout_s

    def set(self, key: str, value: bytes) -> None:
        self._table.set(key, bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._table.get(key)
        if value is None:
            raise RuntimeError(f"store: {key!r} was deleted")
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if not self._table.wait(keys, _seconds(timeout, self._timeout_s)):
            raise RuntimeError(f"store: timed out waiting for {keys}")

    def check(self, keys: list[str]) -> bool:
        return all(self._table.get(k) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        return self._table.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._table.compare_set(key, bytes(expected), bytes(desired))

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (the name c10d calls)
        return self._table.delete(key)

    def getNumKeys(self) -> int:  # noqa: N802
        return len(self._table)

    def clone(self) -> LocalStore:
        return LocalStore(self._table, self._timeout_s)


class StoreClient(dist.Store):  # type: ignore[misc,name-defined]  # c10d's Store has no stubs
    """c10d's view of a receiver's `StoreTable` from the sender's rank (rank 1): requests over a DEALER of its own."""

    def __init__(self, endpoint: str, context: zmq.Context[zmq.Socket[bytes]], timeout_s: float,
                 secret: ClusterSecret | None = None) -> None:
        super().__init__()
        self._endpoint, self._context, self._timeout_s = endpoint, context, timeout_s
        self._secret = auth.resolve(secret)
        self._key = self._secret.derive(auth.STORE_REQUEST)
        self._seq = 0
        self._lock = threading.Lock()
        self._sock: zmq.Socket[bytes] | None = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        apply_limits(sock, max_frame_bytes=SMALL_FRAME_BYTES)
        sock.connect(self._endpoint)
        return sock

    def set(self, key: str, value: bytes) -> None:
        self._call(b"set", key, bytes(value))

    def get(self, key: str) -> bytes:
        return self._poll(key, time.monotonic() + self._timeout_s)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = time.monotonic() + _seconds(timeout, self._timeout_s)
        for key in keys:
            self._poll(key, deadline)

    def check(self, keys: list[str]) -> bool:
        return all(self._call(b"get", k, allow_missing=True) is not None for k in keys)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(b"add", key, str(amount).encode()) or b"0")

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(b"compare_set", key, bytes(expected), bytes(desired)) or b""

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (the name c10d calls)
        return self._call(b"delete", key) == b"1"

    def getNumKeys(self) -> int:  # noqa: N802
        return int(self._call(b"num_keys", "") or b"0")

    def clone(self) -> StoreClient:
        return StoreClient(self._endpoint, self._context, self._timeout_s, self._secret)

    def retire(self) -> None:
        """Close the socket (the group is formed: it needs the store no more); later calls raise."""
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    def _poll(self, key: str, deadline: float) -> bytes:
        pause = _STORE_POLL_S
        while (value := self._call(b"get", key, allow_missing=True)) is None:
            if time.monotonic() + pause > deadline:
                raise RuntimeError(f"store at {self._endpoint}: timed out waiting for {key!r}")
            time.sleep(pause)
            pause = min(pause * 2, 10 * _STORE_POLL_S)
        return value

    def _call(self, op: bytes, key: str, value: bytes = b"", extra: bytes = b"", *,
              allow_missing: bool = False) -> bytes | None:
        with self._lock:
            if self._sock is None:
                raise RuntimeError("store client is closed")
            request = [STORE_MAGIC, op, key.encode(), value, extra]
            self._seq += 1
            tag = auth.seal(self._key, auth.STORE_REQUEST, self._seq, request)
            self._sock.send_multipart([tag, *request])
            if not self._sock.poll(int(self._timeout_s * 1000), zmq.POLLIN):
                # The socket may now hold a late reply: replace it, so that replies never pair up wrongly.
                self._sock.close(linger=0)
                self._sock = self._connect()
                raise RuntimeError(f"store at {self._endpoint}: no answer to {op.decode()} {key!r} (is the "
                                   "receiver's cluster secret ours? it ignores requests whose MAC does not check)")
            parts = self._sock.recv_multipart()
        if len(parts) < 2 or auth.check(self._key, auth.STORE_REPLY, parts[0], [tag, *parts[1:]]) != self._seq:
            raise RuntimeError(f"store at {self._endpoint}: a reply whose MAC does not check")
        reply = parts[1:]
        if len(reply) != 3 or reply[0] != STORE_MAGIC:
            raise RuntimeError(f"store at {self._endpoint}: malformed reply")
        status, result = reply[1], reply[2]
        if status == b"missing" and allow_missing:
            return None
        if status != b"ok":
            raise RuntimeError(f"store at {self._endpoint}: {op.decode()} {key!r}: {result.decode(errors='replace')}")
        return result


__all__ = ["STORE_MAGIC", "LocalStore", "StoreClient", "StoreTable"]
