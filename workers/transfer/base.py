"""The KV transport interface: a sender on the prefill worker, a receiver on the decode worker.

One request's handoff, in order:

  1. D allocates blocks for the prompt and calls `receiver.register(request_id,
     dst_block_ids, expected_layers)`; the block ids reach P with the request.
  2. P, as each layer (or chunk of layers) of the prefill is computed, calls
     `sender.send(request_id, layer, src_block_ids, dst_block_ids, deadline)`:
     K and V of those blocks of that layer go into the same layer of D's cache,
     block for block. Layer 0 can travel while later layers are computed.
  3. P calls `sender.finish(request_id, deadline)`: it returns once D has
     verified every expected layer of every registered block; P frees its blocks.
  4. D sees `wait(...)` / `poll(...)` turn DONE, moves the request to decoding,
     and calls `receiver.release(request_id)`.

Any failure (checksum, timeout, abort on either side, a closed transport, a lost connection) makes
the transfer FAILED on the receiver and raises `TransferError` on the sender at
its next call; each side then frees its blocks. Once the receiver reports a
terminal state, or `abort` returns, nothing more is written into the request's
blocks: late messages are discarded. That is what lets D free or reuse them.

All deadlines are absolute `time.monotonic()` values. No call blocks past its
deadline; calls without one never block on the peer.

Limits of this version: one sender per request (the first transfer id a
registration sees owns it), and sender and receiver caches must agree on dtype,
block size, KV heads and head dim (no heterogeneous tensor parallelism).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.workers.messages import FailReason, TransferState

__all__ = ["FailReason", "KVReceiver", "KVSender", "TransferError", "TransferState", "TransferStatus", "Transport"]


class Transport(str, enum.Enum):
    """Which backend moves KV between workers."""

    ZMQ = "zmq"  # ZeroMQ over TCP: any two hosts
    NCCL = "nccl"  # GPU to GPU (its gloo path when the caches are on the CPU)


class TransferError(RuntimeError):
    """A transfer failed or could not proceed in time; `reason` says which way."""

    def __init__(self, request_id: str, reason: FailReason, detail: str) -> None:
        super().__init__(f"KV transfer of {request_id!r} failed ({reason.value}): {detail}")
        self.request_id = request_id
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TransferStatus:
    """A transfer's state as the receiver sees it; `reason`/`detail` only when FAILED."""

    state: TransferState
    reason: FailReason | None = None
    detail: str = ""

    @property
    def terminal(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = TransferStatus(TransferState.PENDING)
DONE = TransferStatus(TransferState.DONE)


class KVSender(abc.ABC):
    """Sender half, owned by one prefill worker; moves blocks of its cache to one receiver.

    Not meant for concurrent use from several threads (calls are serialized by a lock).
    """

    @abc.abstractmethod
    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        """Queue K and V of `src_block_ids` of `layer` for the receiver's `dst_block_ids` (same order).

        Called by the prefill worker once per layer (or per layer of a chunk) as soon as
        that layer's K/V is written. The first call for a request starts its transfer.
        Blocks only while the receiver has granted no credit (flow control), at most
        until `deadline`; it does not wait for the data to arrive. The blocks may be read
        after it returns (a backend may send them straight from the cache): the caller keeps
        them unchanged until `finish` returns or it calls `abort`, as the prefill worker does
        by holding them. Bytes that change before they leave fail the transfer (CHECKSUM);
        they are never written into the receiver's cache as if they were good.
        Raises `TransferError`: TIMEOUT when no credit came in time (a backend that
        splits a layer into several messages may have sent part of it; retrying the
        call is safe: blocks are rewritten with the same bytes), PEER_LOST when the
        connection to the receiver was lost (or none came up within a few seconds), or the receiver's
        reason once it reported the transfer FAILED (then the transfer is over and
        forgotten: free the blocks). `ValueError` for bad arguments.
        """

    @abc.abstractmethod
    def finish(self, request_id: str, deadline: float) -> None:
        """Mark the transfer complete and wait until the receiver has verified all of it.

        Called by the prefill worker after the last `send` of the request. Blocks until
        the receiver reports DONE, or until `deadline` (then TIMEOUT, and the receiver
        is told to abort), or until the connection is lost (PEER_LOST, within seconds).
        Either way the sender forgets the request: the prefill worker frees its blocks
        after this returns or raises `TransferError`.
        """

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Stop sending this request and tell the receiver (which marks it FAILED/ABORTED).

        Called by the prefill worker when the request is cancelled or its prefill failed.
        Does not block on the peer. Forgets the request; unknown ids are ignored.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Abort unfinished transfers (the receivers are told), release sockets and timers.

        Later calls raise `TransferError(CLOSED)`. Bounded: never blocks past ~1 s.
        """

    def link_down_s(self) -> float:
        """Seconds the connection to the receiver has been down (or never came up); 0
        while it is up, or for a transport with no connection of its own. Does not
        block; the prefill worker retires a link whose peer stays unreachable."""
        return 0.0


class KVReceiver(abc.ABC):
    """Receiver half, owned by one decode worker; writes verified K/V into its cache."""

    address: str  # where senders reach it (what a decode worker puts in its PrefillOrder)

    @abc.abstractmethod
    def register(self, request_id: str, dst_block_ids: Sequence[int], expected_layers: int) -> None:
        """Expect layers `0 .. expected_layers - 1` of `dst_block_ids` for `request_id`.

        Called by the decode worker after allocating the blocks and before the prefill
        worker starts sending (messages for an unregistered request are refused).
        Does not block. `ValueError` for unknown blocks, repeats, or a request already registered.
        """

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus:
        """The transfer's status now. Never blocks. `KeyError` if not registered."""

    @abc.abstractmethod
    def wait(self, request_id: str, deadline: float) -> TransferStatus:
        """Block until the transfer is DONE or FAILED, or until `deadline`.

        At the deadline a PENDING transfer becomes FAILED(TIMEOUT), later data for it is
        discarded, and the sender is told to abort. `KeyError` if not registered.
        """

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> None:
        """Fail the transfer, tell the sender, and forget the request.

        Called by the decode worker when the request is cancelled. When this returns no
        write into the request's blocks is in progress or will happen, so the caller
        may free them. Does not block on the peer. Unknown ids are ignored.
        """

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a request; the decode worker calls it once it acted on a terminal status.

        Releasing a PENDING transfer aborts it (see `abort`). Unknown ids are ignored.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Fail every pending transfer with CLOSED, stop threads (bounded join), free sockets."""
