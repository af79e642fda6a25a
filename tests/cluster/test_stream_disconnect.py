"""A streamed response runs in a task of its own while the request's task waits for it and one
task listens for the client's disconnect (cluster/openai_app.py `_unless_disconnected`): a
disconnect cancels the stream and the request goes on to its cleanup; anyone else's cancel
still cancels the request, and the stream with it; the stream's error is the request's."""

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


async def _wait_for_a_token(cancelled: list[bool]) -> None:
    """What a stream does between tokens; True goes into `cancelled` when it is cancelled."""
    try:
        await asyncio.sleep(WAIT_S)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise


@pytest.mark.parametrize("fail", [False, True])
def test_a_disconnect_cancels_the_stream_and_the_request_goes_on(fail: bool) -> None:
    async def main() -> tuple[bool, bool]:
        gone, cancelled = asyncio.Event(), list[bool]()

        async def stream() -> None:
            gone.set()  # the client leaves while the stream waits for its next token
            await _wait_for_a_token(cancelled)

        async with asyncio.timeout(WAIT_S / 2):
            await _unless_disconnected(stream(), _receive(gone, fail))
        await asyncio.sleep(0)  # the request's task was not left cancelled: this await works
        return cancelled == [True], asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

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
    async def main() -> bool:
        gone, stream_cancelled = asyncio.Event(), list[bool]()
        request: asyncio.Task[None] | None = None

        async def stream() -> None:
            assert request is not None
            request.cancel()  # the server cancels the request's task (shutting down) ...
            gone.set()  # ... as the client leaves
            await _wait_for_a_token(stream_cancelled)

        request = asyncio.ensure_future(_unless_disconnected(stream(), _receive(gone)))
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(WAIT_S / 2):
                await request
        return stream_cancelled == [True]

    assert asyncio.run(main())


def test_a_cancelled_request_cancels_its_stream() -> None:
    async def main() -> bool:
        started, stream_cancelled = asyncio.Event(), list[bool]()

        async def stream() -> None:
            started.set()
            await _wait_for_a_token(stream_cancelled)

        request = asyncio.ensure_future(_unless_disconnected(stream(), _receive(asyncio.Event())))
        await started.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(WAIT_S / 2):
                await request
        return stream_cancelled == [True]

    assert asyncio.run(main())


def test_the_streams_error_is_the_requests() -> None:
    class WriteTimeout(Exception):
        pass

    async def main() -> None:
        async def stream() -> None:
            await asyncio.sleep(0)
            raise WriteTimeout("the client stopped reading")

        async with asyncio.timeout(WAIT_S / 2):
            await _unless_disconnected(stream(), _receive(asyncio.Event()))

    with pytest.raises(WriteTimeout):
        asyncio.run(main())
