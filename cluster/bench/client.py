"""One streamed request -> one `RequestRecord`: its timestamps, token counts, or why it failed.

Timing (shared/design/PERFORMANCE.md): the clock starts just before the POST
(connection set-up included, client-side queueing for --max-concurrency not);
each SSE line is stamped when it is read. A *token chunk* is an event whose
`choices` carry generated output: non-empty text (`text` / `delta.content`), or
an empty-text event that is neither the chat role preamble nor a bare
finish_reason (a token that decodes to no text yet, e.g. half a UTF-8
character). The usage-only event, comments and `[DONE]` are not token chunks.

Output tokens come from the final `usage.completion_tokens`
(`stream_options.include_usage`); without usage, the count of token chunks
(which undercounts when a chunk carries several tokens).

The HTTP client is aiohttp (its parser is C): on a machine the client shares
with the server, the client's CPU is the server's loss. httpx (pure-Python
HTTP/1.1) took 0.24 ms of CPU per streamed token here, about as much as the
gateway that sent it (one colocated tiny-model worker on 2 cores, 2026-11-28).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NotRequired, TypedDict, TypeGuard

import aiohttp


class Endpoint(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/completions" if self is Endpoint.COMPLETIONS else "/chat/completions"


class _StreamOptions(TypedDict):
    include_usage: bool


class _Message(TypedDict):
    role: str
    content: str


class RequestBody(TypedDict):
    """What the bench POSTs: a streamed completion (`prompt`) or chat completion (`messages`)."""

    model: str
    stream: bool
    stream_options: _StreamOptions
    temperature: float
    messages: NotRequired[list[_Message]]
    max_completion_tokens: NotRequired[int]
    prompt: NotRequired[list[int] | str]
    max_tokens: NotRequired[int]
    ignore_eos: NotRequired[bool]


# A streamed event as the server sends it: only the keys the bench reads; any of them may be missing.
class _ChunkDelta(TypedDict, total=False):
    role: str
    content: str | None


class _ChunkChoice(TypedDict, total=False):
    text: str | None  # /v1/completions
    delta: _ChunkDelta | None  # /v1/chat/completions
    finish_reason: str | None


class _ChunkUsage(TypedDict, total=False):
    prompt_tokens: int | None
    completion_tokens: int | None


class StreamChunk(TypedDict, total=False):
    choices: list[_ChunkChoice] | None
    usage: _ChunkUsage | None
    error: object


@dataclass
class RequestRecord:
    """Everything measured about one request; times in seconds."""

    index: int
    input_len: int  # prompt tokens we built
    output_len: int  # tokens we asked for
    scheduled: float  # arrival time, from the start of the run
    sent: float | None = None  # when the POST went out (>= scheduled when --max-concurrency queues it)
    success: bool = False
    error: str | None = None
    ttft: float | None = None  # sent -> first token chunk
    e2e: float | None = None  # sent -> last token chunk
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token chunks
    chunks: int = 0  # token chunks received
    output_tokens: int = 0  # usage.completion_tokens, else `chunks`
    prompt_tokens: int | None = None  # usage.prompt_tokens, as the server counted them
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single output token."""
        if not self.success or self.output_tokens < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(endpoint: Endpoint, model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool,
                 temperature: float = 0.0) -> RequestBody:
    body: RequestBody = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                         "temperature": temperature}
    if endpoint is Endpoint.CHAT:
        if not isinstance(prompt, str):
            raise ValueError("chat endpoint: needs text prompts (give --tokenizer)")
        body["messages"] = [{"role": "user", "content": prompt}]
        # both spellings: newer servers read max_completion_tokens, older ones max_tokens
        body["max_completion_tokens"] = max_tokens
        body["max_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if ignore_eos:  # left out entirely when off: strict servers reject unknown fields
        body["ignore_eos"] = True
    return body


def _event(data: bytes) -> StreamChunk:
    """One event's JSON object; ValueError for anything else (whatever a server sends, the
    run counts it as this request's failure: it does not end the run)."""
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise ValueError(f"an event that is no JSON object: {data[:80]!r}")
    choices = payload.get("choices")
    if choices is not None and not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
        raise ValueError("choices: not a list of objects")
    return payload  # type: ignore[return-value]  # checked as far as this client reads it


def _take_usage(rec: RequestRecord, usage: object) -> None:
    """The server's token counts, where they are counts (a missing or null completion_tokens
    leaves the count to the client, as vLLM's does: not 0 tokens)."""
    if not isinstance(usage, dict):
        raise ValueError("usage: not an object")
    completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if _count(completion):
        rec.usage_reported = True
        rec.output_tokens = completion
    if _count(prompt):
        rec.prompt_tokens = prompt


def _count(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _chunk_text(payload: StreamChunk) -> str:
    """The text a chunk carries (a chat delta's content, or a completion's text), "" for none."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    delta = c.get("delta")
    text = delta.get("content") if delta is not None else c.get("text")
    return text if isinstance(text, str) else ""


def _is_token_chunk(payload: StreamChunk) -> bool:
    choices = payload.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    delta = c.get("delta")
    text = delta.get("content") if delta is not None else c.get("text")
    if text:
        return True
    if delta is not None and "role" in delta:
        return False  # chat's role preamble
    return c.get("finish_reason") is None  # an empty token, not a bare end-of-stream marker


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        d = json.loads(text)
    except ValueError:
        return text.strip()[:200] or "(empty body)"
    err = d.get("error", d) if isinstance(d, dict) else d
    if isinstance(err, dict):
        return str(err.get("message") or err)[:200]
    return str(err)[:200]


async def send(client: aiohttp.ClientSession, url: str, body: RequestBody, timeout_s: float,
               rec: RequestRecord, t0: float, count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """POST `body` to `url`, stream the reply into `rec`. Never raises but for cancellation
    (recorded as 'interrupted', then re-raised): every failure becomes `rec.error`.
    `count_tokens`: the output's tokens from its text when the server reports no usage
    (vLLM's bench re-tokenizes so); without it, the token chunks are counted."""
    times: list[float] = []
    texts: list[str] = []
    done = False
    st = time.perf_counter()
    rec.sent = st - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(url, json=body) as r:
                if r.status != 200:
                    rec.error = f"HTTP {r.status}: {_error_message(await r.read())}"
                    return rec
                async for now, line in _lines(r.content):
                    if not line.startswith(b"data:"):
                        continue  # blank separators and ': keep-alive' comments
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    payload = _event(data)
                    if "error" in payload:
                        rec.error = f"stream error: {_error_message(data)}"
                        return rec
                    if usage := payload.get("usage"):
                        _take_usage(rec, usage)
                    if _is_token_chunk(payload):
                        times.append(now)
                        texts.append(_chunk_text(payload))
                if done:  # read the body's end, so that the connection goes back to the pool open
                    await r.read()
    except TimeoutError:
        if done:  # the answer was whole; only the body's end was late
            return _finish(rec, st, times, done, texts, count_tokens)
        rec.error = f"timeout: no complete response within {timeout_s:g}s ({len(times)} token chunks received)"
        return rec
    except asyncio.CancelledError:
        rec.error = "interrupted"
        raise
    except aiohttp.ClientError as e:
        if done:
            return _finish(rec, st, times, done, texts, count_tokens)
        rec.error = f"{type(e).__name__}: {e}"[:200] or type(e).__name__
        return rec
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError) as e:  # a malformed event
        rec.error = f"bad stream event: {type(e).__name__}: {e}"[:200]
        return rec
    return _finish(rec, st, times, done, texts, count_tokens)


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[float, bytes]]:
    """The body's lines, each with the time its last byte was read. Split here, not by
    the stream's readline: that one refuses a line over 64 KiB (a long event is fine)."""
    pending = b""
    async for chunk in stream.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield now, line
    if pending:
        yield time.perf_counter(), pending


def _finish(rec: RequestRecord, st: float, times: list[float], done: bool, texts: list[str] | None = None,
            count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    rec.chunks = len(times)
    if not done:
        rec.error = f"stream ended before [DONE] ({len(times)} token chunks received)"
        return rec
    if not times:
        rec.error = "no token chunk received"
        return rec
    if not rec.usage_reported:
        rec.output_tokens = len(times) if count_tokens is None or texts is None else count_tokens("".join(texts))
    rec.ttft = times[0] - st
    rec.e2e = times[-1] - st
    rec.itl = [b - a for a, b in zip(times, times[1:])]
    rec.success = True
    return rec


async def first_model(client: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The id of the first model `GET {base_url}/models` lists."""
    try:
        async with asyncio.timeout(timeout_s), client.get(f"{base_url}/models") as r:
            body = await r.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ValueError(f"GET {base_url}/models: {type(e).__name__}: {e} "
                         "(is the server up? or pass --model)") from None
    if r.status != 200:
        raise ValueError(f"GET {base_url}/models: HTTP {r.status}: {_error_message(body)}")
    data = json.loads(body).get("data") or []
    if not data:
        raise ValueError(f"GET {base_url}/models: no models listed; pass --model")
    return str(data[0]["id"])
