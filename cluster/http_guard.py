"""What runs before any route: the request id, the API key, the body's size and
pace, and a deadline on every write to the client.

A plain ASGI middleware (`Guard`), so that it acts before FastAPI reads or
parses anything:

* every request gets an id the server log names it by: the client's `x-request-id`
  (or the one Ray Serve's ingress gave it) with 8 random hex digits after it, unique
  even where clients reuse theirs, else 32 random hex digits; `x-request-id` on its
  response is the client's (Serve's) id, or that one. Under Ray Serve its ingress writes
  that header itself (`echo_request_id` False: one header, not two with two ids);
* the key is checked from the headers alone, before the body is read: an
  unauthenticated client costs no parsing. /health is open; /metrics wants the
  metrics key or the API key, whichever are set (open only when neither is: an
  API key must not leave the workers' fan-out open to anyone); every other path
  (the API, /docs, /openapi.json) wants the API key when one is set;
* the body is read here, whole, under `max_body_bytes` (413, as soon as
  Content-Length or the bytes so far say so) and `body_timeout` (408: a client
  trickling its body in must not hold a connection and its buffer for ever),
  then handed to the app;
* each write to the client waits at most `write_timeout`: a client that stops
  reading a stream is dropped, which ends its response and frees its
  admission slot and its request's KV blocks (openai_app's stream does both
  when it is closed).

Slow headers are left to the HTTP server in front (uvicorn's keep-alive
timeout, HAProxy's `timeout http-request`): no request exists before them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.limits import RefusalReason, RequestLimits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
OnRefused = Callable[["RefusalReason | None", "int | None"], None]

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode()
_ID_CHARS = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
OPEN_PATHS = frozenset({"/health", "/ping"})
METRICS_PATH = "/metrics"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class Keys:
    """The keys a request must carry (`Authorization: Bearer KEY`); None: no key wanted."""

    api_key: str | None = field(default=None, repr=False)
    metrics_api_key: str | None = field(default=None, repr=False)

    def wanted(self, path: str) -> tuple[str, ...]:
        """The keys any one of which opens `path` (empty: it is open)."""
        if path in OPEN_PATHS:
            return ()
        if path == METRICS_PATH:
            return tuple(k for k in (self.metrics_api_key, self.api_key) if k)
        return (self.api_key,) if self.api_key else ()


def request_id(scope: Scope) -> str:
    """The id `Guard` gave the request (a fresh one outside it: tests that call routes directly)."""
    state = scope.setdefault("state", {})
    rid: str | None = state.get("request_id")
    if rid is None:
        given = _given_id(scope)
        if given is None:
            # 128 random bits as uuid4().hex has them, at a fifth of its cost (no UUID object).
            rid = os.urandom(16).hex()
        else:  # a client may send one id twice: the suffix keeps the engines' ids apart
            rid = f"{given}-{os.urandom(4).hex()}"
        state["request_id"], state["given_request_id"] = rid, given
    return rid


def _given_id(scope: Scope) -> str | None:
    """The request's own `x-request-id` (a client's, or Ray Serve's ingress's), if it is one
    an id can be made of: at most 64 of [A-Za-z0-9._:-]."""
    for name, value in scope.get("headers", ()):
        if name == _REQUEST_ID_NAME:
            return value.decode("latin-1") if _ID_CHARS.fullmatch(value) else None
    return None


class WriteTimeout(Exception):
    """The client did not take a write within `write_timeout`."""


class _Refusal(Exception):
    def __init__(self, status: int, message: str, err_type: str, reason: RefusalReason) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.reason = status, message, err_type, reason


class _ClientGone(Exception):
    pass


class Guard:
    """See the module docstring. `on_refused(reason, status)` counts each refusal
    it makes (status None: a client dropped for not reading; reason None: a client
    that went away before its body was all sent, 499)."""

    def __init__(self, app: App, keys: Keys, limits: RequestLimits, on_refused: OnRefused,
                 echo_request_id: bool = True) -> None:
        self.app, self.keys, self.limits, self.on_refused = app, keys, limits, on_refused
        self.echo_request_id = echo_request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id(scope)
        watch = _WriteWatch(self.limits.write_timeout)
        try:
            await self._guarded(scope, receive, self._timed(send, scope, watch))
        finally:
            watch.close()  # on every exit: a refusal's error body armed it too

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self._check_key(scope)
            if scope.get("method") in _BODY_METHODS:
                receive = _replay(await self._read_body(scope, receive), receive)
        except _Refusal as r:
            self.on_refused(r.reason, r.status)
            with contextlib.suppress(WriteTimeout):
                await _send_error(send, r)
            return
        except _ClientGone:  # before its body was all sent: no answer, counted as a client gone
            self.on_refused(None, 499)
            return
        try:
            await self.app(scope, receive, send)
        except* WriteTimeout:
            self.on_refused(RefusalReason.WRITE_TIMEOUT, None)  # the connection is closed with the response cut

    def _check_key(self, scope: Scope) -> None:
        wanted = self.keys.wanted(scope.get("path", ""))
        if not wanted:
            return
        header = _header(scope, b"authorization")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        # Every key compared, in constant time: which key matched, or how far, does not show.
        ok = [secrets.compare_digest(token.encode(), k.encode()) for k in wanted]
        if not any(ok):
            raise _Refusal(401, "invalid or missing API key", "AuthenticationError", RefusalReason.AUTH)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        too_large = _Refusal(413, f"request body: at most {limit} bytes (the server's --max-body-bytes)",
                             "RequestTooLargeError", RefusalReason.BODY_TOO_LARGE)
        length = _header(scope, b"content-length")
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _Refusal(408, f"request body: not received within {self.limits.body_timeout:g} s",
                           "RequestTimeoutError", RefusalReason.BODY_TIMEOUT) from None

    def _timed(self, send: Send, scope: Scope, watch: _WriteWatch) -> Send:
        header = (_REQUEST_ID_NAME, (scope["state"]["given_request_id"] or request_id(scope)).encode())
        echo = self.echo_request_id

        async def timed_send(message: Message) -> None:
            if echo and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            watch.begin()
            try:
                await send(message)
            except asyncio.CancelledError:
                if watch.expired():
                    raise WriteTimeout from None
                raise
            finally:
                watch.since = None

        return timed_send


class _WriteWatch:
    """The write timeout of one response: one timer while the response lives, not one per
    write. A write almost never waits (the server's buffer takes it), and a stream makes one
    per token: an `asyncio.timeout` around each cost a timer, a heap push and a cancel per
    token. The timer runs while a write may be under way (armed by a write, dropped when it
    finds none); a write that has waited `timeout_s` has its task cancelled, which the write
    turns into WriteTimeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.since: float | None = None  # when the write under way began (loop time)
        self._task: asyncio.Task[Any] | None = None  # the task writing (the one its write was made from)
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    def begin(self) -> None:
        loop = asyncio.get_running_loop()
        self.since = loop.time()
        self._task = asyncio.current_task()
        if self._timer is None:
            self._timer = loop.call_at(self.since + self.timeout_s, self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        since = self.since
        if since is not None and loop.time() - since >= self.timeout_s and self._task is not None:
            self._fired = True
            self._task.cancel()
            self._timer = None
            return
        if since is None:  # no write under way: the next write arms the timer again
            self._timer = None
            return
        self._timer = loop.call_at(since + self.timeout_s, self._check)  # within its time: look when it is due

    def expired(self) -> bool:
        """Whether the cancellation came from this watch (taken back: the write raises instead)."""
        if not self._fired:
            return False
        self._fired = False
        if self._task is not None:
            self._task.uncancel()
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body read here, then the client's own messages (its disconnect)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, r: _Refusal) -> None:
    body = json.dumps({"error": {"message": r.message, "type": r.err_type, "param": None, "code": r.status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if r.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if r.status in (408, 413):
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
