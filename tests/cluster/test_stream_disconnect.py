"""A streamed response runs in its request's task while one task listens for the client's
disconnect (cluster/openai_app.py `_unless_disconnected`): a disconnect cancels the stream and
the request goes on to its cleanup; anyone else's cancel still cancels it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.cluster.openai_app import _unless_disconnected

WAIT_S = 5.0


def _receive(disconnect: asyncio.Event, fail: bool = False) -> Any:
    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        if fail:
            raise RuntimeError("the server broke")
        return {"type": "http.disconnect"}

    return receive


@pytest.mark.parametrize("fail", [False, True])
def test_a_disconnect_cancels_the_stream_and_the_request_goes_on(fail: bool) -> None:
    async def main() -> tuple[bool, bool]:
        gone, cancelled = asyncio.Event(), False

        async def stream() -> None:
            nonlocal cancelled
            gone.set()  # the client leaves while the stream waits for its next token
            try:
                await asyncio.sleep(WAIT_S)
            except asyncio.CancelledError:
                cancelled = True
                raise

        async with asyncio.timeout(WAIT_S / 2):
            await _unless_disconnected(stream(), _receive(gone, fail))
        await asyncio.sleep(0)  # the request's task was not left cancelled: this await works
        return cancelled, asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    cancelled, clean = asyncio.run(main())
    assert cancelled and clean


def test_a_stream_that_ends_first_is_not_cancelled_later() -> None:
    async def main() -> str:
        never = asyncio.Event()
        await _unless_disconnected(asyncio.sleep(0.01), _receive(never))
        await asyncio.sleep(0.05)  # a late cancel from the listener would land here
        return "done"

    assert asyncio.run(main()) == "done"


def test_another_cancel_is_not_swallowed() -> None:
    async def main() -> None:
        gone = asyncio.Event()

        async def handler() -> None:
            async def stream() -> None:
                asyncio.current_task().cancel()  # type: ignore[union-attr]  # e.g. the server shutting down
                gone.set()
                await asyncio.sleep(WAIT_S)

            await _unless_disconnected(stream(), _receive(gone))

        task = asyncio.ensure_future(handler())
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(WAIT_S / 2):
                await task

    asyncio.run(main())
