"""A stop's drain, told to the gateway (cluster/shutdown.py raises the flag).

When `pdserve serve` stops, its requests in flight get `shutdown.DRAIN_S` to finish.
Requests that kept arriving meanwhile would keep the drain from ending, and be cut
when it did: so the driver raises a flag in Ray's key-value store (the GCS, which the
gateway's replica reads too), and a gateway that sees it takes no new request (503
with Retry-After, as a server behind a load balancer should while it drains) while
the ones in flight finish; its /health answers 503 "draining".

A gateway still holding requests `STOP_STREAMS_AFTER_S` after it saw the flag ends them with an
error (503: a streamed one gets an error event and `[DONE]`), so that the processes' shutdown at
the drain's end cuts no stream with nothing said.

The key names the app's port: a later start on the same Ray cluster lowers it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pdserve.cluster.shutdown import DRAIN_S

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a gateway reads the flag: a stop is seen within this
# By when, from its raising, every gateway has read the flag (a poll, and the read itself, a GCS
# call off the loop): until then one may still admit requests, so a drain that counts none in
# flight before it has counted nothing (cluster/shutdown.py `_drain`).
SEEN_WITHIN_S = POLL_S + 0.2
# When a gateway ends what it still holds, from its reading the flag: before the drain's end (the
# flag raised at most SEEN_WITHIN_S before it was read), with room for the last events to be written
# before Serve's shutdown (the drain stops at its end whether or not it has read the count at 0 since).
# Every request still running then ends early, so the room is kept small.
STOP_STREAMS_AFTER_S = DRAIN_S - SEEN_WITHIN_S - 0.8


def _key(port: int) -> bytes:
    return f"pdserve:draining:{port}".encode()


def raise_flag(port: int) -> None:
    """The driver: the stop began (no-op where this process is not connected to Ray)."""
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(_key(port), b"1", overwrite=True)


def lower_flag(port: int) -> None:
    """The driver, once connected to Ray at start: an earlier run's flag is gone."""
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(_key(port))


def is_raised(port: int) -> bool:
    """Whether the app on `port` is stopping (False where this process is not connected to Ray)."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_initialized() and internal_kv._internal_kv_exists(_key(port)))


class DrainWatch:
    """Reads the flag every `poll_s` (off the event loop: a GCS call blocks) until it is
    raised, then calls `on_drain()` once, on the loop, and stops."""

    def __init__(self, port: int, on_drain: Callable[[], None], poll_s: float = POLL_S,
                 read: Callable[[int], bool] = is_raised) -> None:
        self.port, self.on_drain, self.poll_s, self.read = port, on_drain, poll_s, read
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the running event loop (the app's startup)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-drain-watch")

    async def _run(self) -> None:
        while True:
            try:
                raised = await asyncio.to_thread(self.read, self.port)
            except Exception:  # noqa: BLE001 - a GCS that does not answer now: read it again later
                log.debug("reading the drain flag failed", exc_info=True)
                raised = False
            if raised:
                self.on_drain()
                return
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
