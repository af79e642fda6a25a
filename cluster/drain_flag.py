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

The flag is also a file on the driver's machine (`flag_path`), which a gateway there reads on its
event loop: local Ray's GCS can be the reason for the stop (cluster/ray_vitals.py), and then the key
cannot be written, and a read of it blocks until Ray gives up on the GCS, 60 s later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
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


def flag_path(port: int) -> str:
    """The flag's file on this machine (the port lock's directory: one run a port, cluster/port_lock.py)."""
    return os.path.join(tempfile.gettempdir(), f"pdserve-draining-{port}")


def raise_flag(port: int, gcs: bool = True) -> None:
    """The driver: the stop began. The file first (it needs no GCS), then the key where this
    process is connected to Ray and `gcs` (False: local Ray's GCS is gone, and the write would
    block until Ray gives up on it)."""
    with contextlib.suppress(OSError):  # a file another user left there (not read: `file_raised`)
        with open(flag_path(port), "w"):
            pass
    if not gcs:
        return
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(_key(port), b"1", overwrite=True)


def lower_flag(port: int) -> None:
    """The driver, once connected to Ray at start: an earlier run's flag is gone."""
    with contextlib.suppress(OSError):
        os.unlink(flag_path(port))
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(_key(port))


def file_raised(port: int) -> bool:
    """Whether the flag's file is there, made by this user: on a shared /tmp another user could
    make it, and would stop every gateway on this machine from taking requests."""
    try:
        return os.stat(flag_path(port)).st_uid == os.getuid()
    except OSError:
        return False


def is_raised(port: int) -> bool:
    """Whether the app on `port` is stopping (False where this process is not connected to Ray)."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_initialized() and internal_kv._internal_kv_exists(_key(port)))


class DrainWatch:
    """Reads the flag every `poll_s` until it is raised, then calls `on_drain()` once, on the
    loop, and stops: its file on the loop (a stat), the key off it (a GCS call blocks; while one
    is under way no other starts, and the file is read all the same)."""

    def __init__(self, port: int, on_drain: Callable[[], None], poll_s: float = POLL_S,
                 read: Callable[[int], bool] = is_raised,
                 read_file: Callable[[int], bool] = file_raised) -> None:
        self.port, self.on_drain, self.poll_s, self.read, self.read_file = port, on_drain, poll_s, read, read_file
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """On the running event loop (the app's startup)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pdserve-drain-watch")

    async def _run(self) -> None:
        reading: asyncio.Future[bool] | None = None
        try:
            while True:
                if reading is None:
                    reading = asyncio.ensure_future(asyncio.to_thread(self.read, self.port))
                raised = self.read_file(self.port)
                if reading.done():
                    try:
                        raised = reading.result() or raised
                    except Exception:  # noqa: BLE001 - a GCS that does not answer now: read it again later
                        log.debug("reading the drain flag failed", exc_info=True)
                    reading = None
                if raised:
                    self.on_drain()
                    return
                await asyncio.sleep(self.poll_s)
        finally:
            if reading is not None:
                reading.cancel()  # (a thread's read cannot be stopped: its result is dropped)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
