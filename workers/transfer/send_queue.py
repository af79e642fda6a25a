"""A KV sender driven from a thread of its own, so an engine thread never waits on a peer.

`KVSender.send` blocks while the receiver grants no credit and `finish` until the
receiver's verdict: on the prefill worker's engine thread, one slow, hung or dead
decode worker would stall every prefill there, for as long as a request's
deadline. The engine thread queues the work here instead and hears the outcome
through a callback; each queued call waits at most `wait_s` on the peer.

One queue per destination (decode worker): calls keep their order per link (a
request's end marker after its data), and a stalled link holds only its own
transfers. A call whose request was cancelled before its turn is skipped.

Streams: given a `CopyStream`, the thread runs every call with it current, so the
sender's gathers (and NCCL's sends, which follow the caller's stream) stay off the
engine's stream; a call orders itself after the engine's work with an event
(`streams.wait_for`), as the prefill worker's do.

Retirement: a decode worker that restarts listens at a new address, so the queue to
its old one would keep a thread and a socket reconnecting for ever. A queue that no
transfer holds (`hold`/`release`), with nothing queued, whose peer has been
unreachable for `retire_after_s`, closes itself and its sender and tells its owner
(`on_retire`); a later transfer to that address opens a new one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.workers.thread_names import name_os_thread
from pdserve.workers.transfer.base import FailReason, KVSender, TransferError
from pdserve.workers.transfer.streams import CopyStream

log = logging.getLogger(__name__)

_JOIN_S = 2.0
_IDLE_CHECK_S = 1.0  # how often an idle queue looks at its link
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
    def __init__(self, sender: KVSender, wait_s: float, name: str = "kv-send", *,
                 retire_after_s: float | None = None, on_retire: Callable[[SendQueue], None] | None = None,
                 stream: CopyStream | None = None) -> None:
        """`wait_s`: how long one queued call may wait on the peer (for a credit, for
        the verdict) before it fails with TIMEOUT, whatever the request's deadline.
        `retire_after_s`: close when idle and the peer has been unreachable this long
        (None: never); then `on_retire(self)` runs on this queue's thread.
        `stream`: current on this queue's thread for every call (None: the default)."""
        if wait_s <= 0:
            raise ValueError(f"wait_s: must be > 0, got {wait_s}")
        if retire_after_s is not None and retire_after_s <= 0:
            raise ValueError(f"retire_after_s: must be > 0 or None, got {retire_after_s}")
        self.sender = sender
        self.wait_s = wait_s
        self._retire_after_s = retire_after_s
        self._on_retire = on_retire
        self._stream = stream
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # `_closed` and `_holders`: retiring must not race a new holder
        self._closed = False
        self._holders = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def hold(self) -> bool:
        """A transfer will use this queue: it is not retired until `release`. False when
        it is already closed (open a new one)."""
        with self._lock:
            if self._closed:
                return False
            self._holders += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1

    def submit(self, request_id: str, work: Work, deadline: float, done: Done,
               cancelled: Callable[[], bool] = lambda: False) -> None:
        """Run `work(sender, wait_deadline)` on this queue's thread, then `done(error)`
        (on that thread; error None when it succeeded). `deadline`: the request's; each
        call's waits end at the earlier of it and now + `wait_s`. Never blocks."""
        with self._lock:  # a `close` between the check and the put would leave the call behind its stop marker
            if not self._closed:
                self._tasks.put(_Task(request_id, work, deadline, done, cancelled))
                return
        done(TransferError(request_id, FailReason.CLOSED, "send queue is closed"))

    def close(self) -> None:
        """Stop the thread after the calls already queued (bounded by `_JOIN_S`). The
        sender is the caller's to close."""
        with self._lock:
            self._closed = True
        self._tasks.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(_JOIN_S)

    def _run(self) -> None:
        name_os_thread("pd-kv-send")
        with self._stream if self._stream is not None else contextlib.nullcontext():
            self._serve()

    def _serve(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=_IDLE_CHECK_S if self._retire_after_s is not None else None)
            except queue.Empty:
                if self._retired():
                    return
                continue
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

    def _retired(self) -> bool:
        """Idle: retire when nothing holds or waits on this queue and the peer has been
        unreachable for `retire_after_s` (this thread owns the sender)."""
        assert self._retire_after_s is not None
        try:
            down_s = self.sender.link_down_s()
        except Exception:  # noqa: BLE001 - a sender that cannot tell is kept
            log.exception("KV link check failed")
            return False
        if down_s < self._retire_after_s:
            return False
        with self._lock:
            if self._closed or self._holders > 0 or not self._tasks.empty():
                return False
            self._closed = True
        log.info("KV link %s retired: its peer has been unreachable for %.1f s", self._thread.name, down_s)
        try:
            if self._on_retire is not None:
                self._on_retire(self)
        finally:
            self.sender.close()
        return True
