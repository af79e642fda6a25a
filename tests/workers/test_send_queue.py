"""A KV link's send queue: calls run in order on its own thread, and a link whose
peer stays unreachable closes itself once no transfer holds it (a restarted decode
worker listens at a new address: the old link would otherwise reconnect for ever)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from pdserve.workers.transfer.base import FailReason, KVSender, TransferError
from pdserve.workers.transfer.send_queue import SendQueue


class FakeSender(KVSender):
    def __init__(self) -> None:
        self.down_s = 0.0
        self.closed = threading.Event()
        self.calls: list[str] = []

    def send(self, request_id: str, layer: int, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             deadline: float) -> None:
        self.calls.append(f"send {request_id}")

    def finish(self, request_id: str, deadline: float) -> None:
        self.calls.append(f"finish {request_id}")

    def abort(self, request_id: str, reason: str) -> None:
        self.calls.append(f"abort {request_id}")

    def close(self) -> None:
        self.closed.set()

    def link_down_s(self) -> float:
        return self.down_s


def _wait(cond: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False




def test_a_held_link_is_kept_and_retires_once_released() -> None:
    sender = FakeSender()
    retired: list[SendQueue] = []
    q = SendQueue(sender, 1.0, retire_after_s=0.5, on_retire=retired.append)
    try:
        assert q.hold()
        sender.down_s = 60.0  # the peer is gone
        time.sleep(2.5)  # two idle checks: held, so kept
        assert not q.closed and not retired and not sender.closed.is_set()
        results: list[TransferError | None] = []
        q.submit("r", lambda s, _: s.abort("r", "x"), time.monotonic() + 5, results.append)
        assert _wait(lambda: results == [None]) and sender.calls == ["abort r"]
        q.release()
        assert _wait(lambda: q.closed and retired == [q] and sender.closed.is_set(), 4.0)
        assert not q.hold(), "a retired link takes no new holder"
        q.submit("late", lambda s, _: s.finish("late", 0.0), time.monotonic() + 5, results.append)
        assert isinstance(results[-1], TransferError) and results[-1].reason is FailReason.CLOSED
        assert sender.calls == ["abort r"]
    finally:
        q.close()


def test_a_link_whose_peer_is_up_or_back_is_kept() -> None:
    sender = FakeSender()
    retired: list[SendQueue] = []
    q = SendQueue(sender, 1.0, retire_after_s=3.0, on_retire=retired.append)
    try:
        sender.down_s = 2.0  # down, but not for long enough
        time.sleep(2.5)
        sender.down_s = 0.0  # reconnected
        time.sleep(1.5)
        assert not q.closed and not retired and not sender.closed.is_set()
    finally:
        q.close()
    assert not sender.closed.is_set(), "close() leaves the sender to its owner"


def test_no_retirement_unless_asked() -> None:
    sender = FakeSender()
    sender.down_s = 1e6
    q = SendQueue(sender, 1.0)
    try:
        time.sleep(1.5)
        assert not q.closed
    finally:
        q.close()


class _CloseBetweenCheckAndPut:
    """The queue of a SendQueue whose `close` (from another thread) runs while a `submit`
    stands between its closed-check and its put: given up to 0.3 s to finish first."""

    def __init__(self, q: SendQueue) -> None:
        self.q, self.inner = q, q._tasks

    def put(self, item: object) -> None:
        if item is not None:
            closer = threading.Thread(target=self.q.close)
            closer.start()
            closer.join(0.3)
        self.inner.put(item)  # type: ignore[arg-type]

    def get(self, *args: object, **kwargs: object) -> object:
        return self.inner.get(*args, **kwargs)  # type: ignore[arg-type]

    def empty(self) -> bool:
        return self.inner.empty()


def test_a_call_submitted_as_the_queue_closes_is_run_or_refused_never_lost() -> None:
    # A prefill worker closes a link (role switch, shutdown) while its engine thread submits a
    # transfer's call: the call must be run or refused with CLOSED. Queued behind the thread's
    # stop marker it was neither, and the transfer's callback (which frees its blocks) never ran.
    sender = FakeSender()
    q = SendQueue(sender, 1.0)
    q._tasks = _CloseBetweenCheckAndPut(q)  # type: ignore[assignment]
    results: list[TransferError | None] = []
    try:
        q.submit("r", lambda s, _: s.finish("r", 0.0), time.monotonic() + 5, results.append)
        assert _wait(lambda: len(results) == 1, 3.0), "the call was neither run nor refused"
    finally:
        q.close()
