"""The gateway's calls in flight on each worker, and the one way to fail them when
the worker is given up without having died (the stall watch: cluster/stall_watch.py).

A worker that hangs (SIGSTOP, a step that never returns) fails no call by itself:
its calls would wait for the request's deadline. A call awaited through
`WorkerCalls.run` ends instead with the give-up's error when `give_up` comes
first, and the gateway moves its request on. The call itself is left behind (the
gateway's abort and the token stream's try numbers deal with what it still sends).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class WorkerCalls:
    """Worker id -> the calls on it in flight now, each with what fails it. Use on one event loop."""

    def __init__(self) -> None:
        self._on: dict[str, set[asyncio.Future[None]]] = {}

    def counts(self) -> dict[str, int]:
        """Worker id -> its calls in flight now (workers with none are left out)."""
        return {wid: len(on) for wid, on in self._on.items()}

    def give_up(self, wid: str, error: Callable[[], BaseException]) -> None:
        """Fail every call in flight on `wid` with a fresh `error()` each (those running now;
        later calls are not affected)."""
        for given_up in self._on.get(wid, ()):
            if not given_up.done():
                given_up.set_exception(error())

    async def run(self, wid: str, call: Awaitable[None]) -> None:
        """Await `call`, a call on worker `wid`: its result or error, or the give-up's error
        if `give_up(wid)` comes first."""
        rpc = asyncio.ensure_future(call)
        given_up: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        on = self._on.setdefault(wid, set())
        on.add(given_up)
        try:
            await asyncio.wait((rpc, given_up), return_when=asyncio.FIRST_COMPLETED)
            if rpc.done():  # its own outcome first, even if the worker was given up meanwhile
                return rpc.result()
            return given_up.result()  # raises the give-up's error
        finally:
            on.discard(given_up)
            if not on and self._on.get(wid) is on:
                del self._on[wid]
            for f in (rpc, given_up):
                if not f.done():
                    f.cancel()
            if not given_up.cancelled():
                given_up.exception()  # read: a give-up the call's own end overtook is not reported as lost
