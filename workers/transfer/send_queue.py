"""A KV sender driven from a thread of its own, so an engine thread never waits on a peer.

`KVSender.send` blocks while the receiver grants no credit and `finish` until the
receiver's verdict: on the prefill worker's engine thread, one slow, hung or dead
decode worker would stall every prefill there, for as long as a request's
deadline. The engine thread queues the work here instead and hears the outcome
through a callback; each queued call waits at most `wait_s` on the peer.

One queue per destination (decode worker): calls keep their order per link (a
request's end marker after its data), and a stalled link holds only its own
transfers. A call whose request was cancelled before its turn is skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.workers.transfer.base import FailReason, KVSender, TransferError

log = logging.getLogger(__name__)

_JOIN_S = 2.0
Work = Callable[[KVSender, float], None]  # (sender, the deadline of this call's waits)
Done = Callable[[TransferError | None], None]


@dataclass(frozen=True)
class _Task:
    request_id: str
    work: Work
    deadline: float
    done: Done
    cancelled: Callable[[], bool]


class SendQueue:
    def __init__(self, sender: KVSender, wait_s: float, name: str = "kv-send") -> None:
        """`wait_s`: how long one queued call may wait on the peer (for a credit, for
        the verdict) before it fails with TIMEOUT, whatever the request's deadline."""
        if wait_s <= 0:
            raise ValueError(f"wait_s: must be > 0, got {wait_s}")
        self.sender = sender
        self.wait_s = wait_s
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, work: Work, deadline: float, done: Done,
               cancelled: Callable[[], bool] = lambda: False) -> None:
        """Run `work(sender, wait_deadline)` on this queue's thread, then `done(error)`
        (on that thread; error None when it succeeded). `deadline`: the request's; each
        call's waits end at the earlier of it and now + `wait_s`. Never blocks."""
        if self._closed:
            done(TransferError(request_id, FailReason.CLOSED, "send queue is closed"))
            return
        self._tasks.put(_Task(request_id, work, deadline, done, cancelled))

    def close(self) -> None:
        """Stop the thread after the calls already queued (bounded by `_JOIN_S`)."""
        self._closed = True
        self._tasks.put(None)
        self._thread.join(_JOIN_S)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if task.cancelled():
                continue
            error: TransferError | None = None
            try:
                task.work(self.sender, min(task.deadline, time.monotonic() + self.wait_s))
            except TransferError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - a bug must fail the transfer, not kill the link's thread
                log.exception("KV send of %s failed", task.request_id)
                error = TransferError(task.request_id, FailReason.CLOSED, f"sender failed: {e!r}")
            try:
                task.done(error)
            except Exception:  # noqa: BLE001
                log.exception("KV send callback failed")

