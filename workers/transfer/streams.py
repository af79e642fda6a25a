"""CUDA streams and events for the transports' copies; nothing at all where the caches are on the CPU.

Why. The engines compute on their thread's current stream (the device's default stream). A transport
that gathered or scattered KV on that stream would queue its copies behind the engine's kernels and
the engine's next kernels behind its copies, and a host `synchronize()` of that stream, to know a
write is over, would also wait for every decode kernel queued there. So the copies run on a side
stream of their own (`CopyStream`, one per thread that copies) and are ordered by events:

* sender: the engine thread records an event after the step that wrote a request's blocks (`record`);
  the link thread's stream waits for it (`wait_for`, on the device: the host does not block) before
  its gather reads them; NCCL's send waits for the gather (ProcessGroupNCCL orders its own stream after
  the caller's current stream).
* receiver: a pair thread's `recv` lands in staging on NCCL's stream; `work.wait()` orders the pair's
  stream after it; the scatter into the cache runs there. The ledger records an event after it
  (`record(..., side_only=True)`) and, before it lets anyone see the transfer end (DONE, FAILED,
  aborted, released), waits on the host for those events only (`wait_done`, with a deadline): the
  decode engine then reads blocks whose writes are over, and blocks handed back are written by no one.
  Before its first write the scatter waits (on the device) for an event the engine thread recorded
  when it registered the blocks: with async scheduling a step still in flight may write one slot of
  a request it dropped into a block freed and reserved since.

On the CPU every function here does nothing and returns None: there is nothing to order.
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import Any

import torch

_POLL_S = 50e-6  # wait_done's sleep between looks: writes it waits for are single device copies


class CopyStream:
    """A side stream on `device` made current by `with`; a no-op context on the CPU (or without CUDA).

    Use one per thread: everything the thread queues inside the `with` goes on this stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = (torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                            if device.type == "cuda" and torch.cuda.is_available() else None)
        self._ctx: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> CopyStream:
        self._ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._ctx is not None
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(kind, error, tb)


def record(device: torch.device, *, side_only: bool = False) -> Any:
    """An event after the work queued so far on this thread's current stream of `device`; None on the CPU.

    `side_only`: None too when the current stream is the device's default stream: the engine's later
    kernels queue behind that work anyway (a ZeroMQ receiver's I/O thread writes there)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    stream = torch.cuda.current_stream(device)
    if side_only and stream == torch.cuda.default_stream(device):
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def wait_for(event: Any, device: torch.device) -> None:
    """Make this thread's current stream of `device` wait for `event` (on the device: the host goes on).

    None (or a CPU device): nothing to wait for."""
    if event is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(event)


def wait_done(event: Any, deadline: float) -> bool:
    """Wait on the host until the work before `event` is over; False if it is not by `deadline`.

    Only that stream's work counts, not the engine's. None is done."""
    if event is None:
        return True
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


__all__ = ["CopyStream", "record", "wait_done", "wait_for"]
