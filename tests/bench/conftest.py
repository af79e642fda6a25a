"""A fake OpenAI-compatible streaming server with known, deterministic delays.

Plain asyncio HTTP/1.1 on 127.0.0.1 in a background thread (its own event
loop, so the benchmark under test can call asyncio.run itself). Each streamed
request: the first token after `first_token_delay`, then a chunk every
`token_interval * tokens_per_chunk`; the usage chunk and [DONE] at the end.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class FakeBehaviour:
    first_token_delay: float = 0.05  # D1: request received -> first token chunk
    token_interval: float = 0.01  # D2: per output token
    tokens_per_chunk: int = 1  # > 1: several tokens per chunk, like speculative decoding
    fail_every: int = 0  # every k-th request (by arrival) gets HTTP 500
    hang_every: int = 0  # every k-th request never answers
    usage: bool = True  # send the include_usage chunk
    model: str = "fake-model"


@dataclass
class FakeServer:
    behaviour: FakeBehaviour
    base_url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    _count: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.AbstractServer | None = None
    _thread: threading.Thread | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> FakeServer:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            port = self._server.sockets[0].getsockname()[1]
            self.base_url = f"http://127.0.0.1:{port}/v1"
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(5)
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        assert self._loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            length = next((int(h.split(":", 1)[1]) for h in head.split("\r\n")
                           if h.lower().startswith("content-length:")), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method == "GET" and path == "/v1/models":
                await self._json(writer, 200, {"object": "list", "data": [{"id": self.behaviour.model}]})
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._generate(writer, body, chat=path.endswith("chat/completions"))
            else:
                await self._json(writer, 404, {"error": {"message": f"no route {path}"}})
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any], chat: bool) -> None:
        b = self.behaviour
        self.bodies.append(body)
        self._count += 1
        if b.fail_every and self._count % b.fail_every == 0:
            await self._json(writer, 500, {"error": {"message": "injected failure", "type": "InternalServerError",
                                                     "code": 500}})
            return
        if b.hang_every and self._count % b.hang_every == 0:
            await asyncio.sleep(3600)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")

        async def event(obj: dict[str, Any] | str) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if chat:  # the role preamble goes out at once: it is not a token
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]})
        ping = b": keep-alive\n\n"  # an SSE comment, which clients must skip
        writer.write(f"{len(ping):x}\r\n".encode() + ping + b"\r\n")
        await asyncio.sleep(b.first_token_delay)
        sent = 1
        await event({"choices": [choice("t0", "length" if n == 1 else None)]})
        while sent < n:
            k = min(b.tokens_per_chunk, n - sent)
            await asyncio.sleep(b.token_interval * k)
            sent += k
            await event({"choices": [choice("".join(f" t{i}" for i in range(k)), "length" if sent == n else None)]})
        if b.usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt = body.get("prompt")
            await event({"choices": [], "usage": {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 0,
                                                  "completion_tokens": n, "total_tokens": n}})
        await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    """Parametrize indirectly with a FakeBehaviour, or get the defaults."""
    behaviour = getattr(request, "param", None) or FakeBehaviour()
    server = FakeServer(behaviour).start()
    try:
        yield server
    finally:
        server.stop()
