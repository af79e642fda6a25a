"""An LLMEngine driven by its own thread, with an asyncio-facing API.

The engine is single-threaded by design; this class owns the thread that
steps it and is the only code that touches it. Callers (the HTTP gateway, a
worker actor) submit requests and read their token deltas from an async
iterator. Every wait has a deadline; every exit path (finish, abort, caller
cancellation, deadline, engine failure) ends the request in the engine, which
frees its blocks, and ends the caller's iterator with a terminal output or an
exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput, merge_deltas
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.token_stream import StreamLostError, TokenStreamPublisher


class EngineDeadError(RuntimeError):
    """The engine thread failed; every in-flight request fails with this."""


class RequestTimeoutError(TimeoutError):
    """A request passed its deadline; it was aborted and its blocks freed."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    deadline: float
    reply_to: str | None = None  # a gateway's token stream: deltas go there, batched per step


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.002,
                 on_step: Callable[[LLMEngine], None] | None = None, worker_id: str = "engine") -> None:
        self.engine = engine
        self.worker_id = worker_id
        self._publisher: TokenStreamPublisher | None = None  # engine thread only
        self._finished_remote: list[RequestOutput] = []  # engine thread only
        # Runs on the engine thread after every step (a prefill worker sends
        # the KV of blocks that step completed).
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, timeout_s: float = 600.0,
        reply_to: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs until the request finishes. Bad input raises
        ValueError before anything is queued; a passed deadline raises
        RequestTimeoutError; an engine failure raises EngineDeadError.
        `reply_to`: see `stream`."""
        self.engine.validate(prompt, params)
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        async for out in self.stream(request_id, lambda e: e.add_request(request_id, prompt, params), timeout_s,
                                     reply_to):
            yield out

    async def stream(
        self, request_id: str, start: Callable[[LLMEngine], RequestOutput | None], timeout_s: float = 600.0,
        reply_to: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run `start(engine)` on the engine thread (it puts the request into the
        engine, and may return a first output), then yield the request's outputs
        until it finishes. Same exits and guarantees as `generate`.

        `reply_to`: the address of a gateway's token stream
        (workers/token_stream.py). The deltas go there, one message per engine
        step for all of that gateway's requests; this yields only the final
        output, once its delta has been sent."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic() + timeout_s, reply_to)
        self._streams[request_id] = stream
        self._commands.put(lambda: self._start(request_id, start))
        try:
            while True:
                remaining = stream.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=max(remaining, 0.0))
                except TimeoutError:
                    raise RequestTimeoutError(f"request {request_id} exceeded its {timeout_s:.0f}s deadline") from None
                if isinstance(item, BaseException):
                    raise item
                # A consumer that fell behind gets everything pending as one
                # delta: fewer messages through Ray and HTTP under load.
                while not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        stream.queue.put_nowait(nxt)  # raised on the next turn, after this delta
                        break
                    item = merge_deltas(item, nxt)
                yield item
                if item.finished:
                    return
        finally:
            # Any exit before the terminal output (cancellation, timeout, error)
            # aborts the request so the engine frees its blocks.
            if self._streams.pop(request_id, None) is not None:
                self._commands.put(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self.engine.abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object], timeout_s: float = 30.0) -> object:
        """Run `fn(engine)` on the engine thread (e.g. to read counters safely) and
        return its result. EngineDeadError if the engine is not running;
        TimeoutError if the engine thread does not get to it in `timeout_s`."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await asyncio.wait_for(fut, timeout=timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)

    # -- engine thread ---------------------------------------------------------

    def _start(self, request_id: str, start: Callable[[LLMEngine], RequestOutput | None]) -> None:
        if request_id not in self._streams:
            return  # the caller went away before the request reached the engine
        try:
            first = start(self.engine)
        except ValueError as e:
            self._deliver(request_id, e)
            return
        if first is not None:
            self._deliver(request_id, first)

    def _run(self) -> None:
        try:
            idle = True
            while not self._stop.is_set():
                # Block for commands when there is nothing to step, or when the
                # last step could schedule nothing (requests waiting only for
                # their KV, or for blocks): spinning here would hold the GIL
                # that the transfer thread and the event loop need.
                self._drain_commands(block=idle)
                idle = True
                if self.engine.has_unfinished_requests():
                    steps = self.engine.stats.steps
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    idle = self.engine.stats.steps == steps
                if self._on_step is not None:
                    self._on_step(self.engine)
                self._flush_remote()
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))
        finally:
            if self._publisher is not None:
                self._publisher.close()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s * 50) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if stream.reply_to is not None and isinstance(item, RequestOutput):
            if self._publisher is None:
                self._publisher = TokenStreamPublisher(self.worker_id)
            self._publisher.add(stream.reply_to, item)
            if item.finished:  # the caller hears of it once the delta is sent
                self._finished_remote.append(item)
            return
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _flush_remote(self) -> None:
        """Send this iteration's token deltas, then tell the callers whose requests ended."""
        if self._publisher is None:
            return
        for rid in self._publisher.flush():
            self.engine.abort(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                 StreamLostError(f"{rid}: its gateway stopped reading tokens"))
        finished, self._finished_remote = self._finished_remote, []
        for out in finished:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)


def _set_result(fut: asyncio.Future[object], value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[object], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
