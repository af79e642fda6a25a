"""The chaos harness's load: probes (prompts whose greedy completions the offline
engine computed: the oracle) and `Load`, concurrent streaming clients over them, each
request ending as one `Outcome` (see harness.py); `HealthWatch`, /health polled
through a fault."""

from __future__ import annotations

import asyncio
import enum
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

# The dtype of the server and of the oracle. The exact-text check needs outputs that do
# not depend on which requests share a step: float32 on CPU gives that; bfloat16 (the
# CPU default where the CPU has AVX512-BF16 or AMX) does not: on the Intel Xeon with AMX,
# 5-9 of 16 greedy outputs of 96 tokens differed between batch 16 and batch 1 (compiled
# or eager, packed linears or not), as vLLM's outputs do by default.
EXACT_DTYPE = "float32"
REPLICA_HEADER = "x-pdserve-replica"  # the gateway replica's rank, on every response (docs/api.md)


# --- probes and their oracle ---------------------------------------------------------


# Where a probe is sent: its prompt as token ids to /v1/completions, or as one user
# message's text to /v1/chat/completions or /v1/responses (the model's chat template).
ENDPOINTS = ("completions", "chat", "responses")


@dataclass(frozen=True)
class Probe:
    prompt: tuple[int, ...]
    max_tokens: int
    text: str  # the greedy completion, computed offline
    endpoint: str = "completions"  # one of ENDPOINTS
    message: str = ""  # chat's and responses' user message (its text decoded from `prompt`)


def make_probes(model: str, count: int, seed: int, max_tokens: int, prompt_len: tuple[int, int] = (40, 120),
                max_model_len: int = 2048, vocab: tuple[int, int] = (5, 4000),
                dtype: str = EXACT_DTYPE, endpoints: Sequence[str] = ("completions",)) -> list[Probe]:
    """`count` prompts of random token ids (lengths in `prompt_len`: over the router's
    16-token local-prefill threshold, so they are handed off) with their greedy
    completions from the offline engine on the same model, in `dtype` (the server's).
    Probe i goes to `endpoints[i % len(endpoints)]`; a chat or responses probe's message
    is its ids' text, and its oracle `LLM.chat` on that message."""
    import torch

    from pdserve import LLM, SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(*vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(count)]
    where = [endpoints[i % len(endpoints)] for i in range(count)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, threads)))
    try:
        llm = LLM(model, max_model_len=max_model_len, dtype=dtype, progress=False)
        messages = ["" if e == "completions" else llm.tokenizer.decode(p) for p, e in zip(prompts, where)]
        texts = {i: o.outputs[0].text for i, o in zip(
            [i for i, e in enumerate(where) if e == "completions"],
            llm.generate([p for p, e in zip(prompts, where) if e == "completions"], params))}
        chats = [i for i, e in enumerate(where) if e != "completions"]
        if chats:
            outs = llm.chat([[{"role": "user", "content": messages[i]}] for i in chats], params)
            texts |= {i: o.outputs[0].text for i, o in zip(chats, outs)}
    finally:
        torch.set_num_threads(threads)
    return [Probe(tuple(p), max_tokens, texts[i], where[i], messages[i]) for i, p in enumerate(prompts)]


def request_of(probe: Probe) -> tuple[str, dict[str, object]]:
    """The path and body that stream `probe`'s greedy answer, usage included."""
    common = {"temperature": 0.0, "stream": True, "ignore_eos": True}
    if probe.endpoint == "responses":
        return "/v1/responses", {"input": probe.message, "max_output_tokens": probe.max_tokens, **common}
    usage = {"stream_options": {"include_usage": True}}
    if probe.endpoint == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": probe.message}],
                                        "max_tokens": probe.max_tokens, **common, **usage}
    return "/v1/completions", {"prompt": list(probe.prompt), "max_tokens": probe.max_tokens, **common, **usage}


@dataclass
class StreamEvent:
    """What one SSE data line of any endpoint's stream says (`read_event`)."""

    text: str = ""  # output text it adds
    finish: str | None = None  # the choice's finish reason ("length" for an incomplete response)
    tokens: int | None = None  # completion tokens, where it reports usage
    error: tuple[int | None, str] | None = None  # (status code, "type: message") of an in-band error
    done: bool = False  # the stream's last event: [DONE], or a response's terminal event


# The HTTP status of an in-band Responses error (its `code` is the error's type).
_STATUS_OF_TYPE = {"BadRequestError": 400, "InternalServerError": 500, "ServiceUnavailableError": 503,
                   "RequestTimeoutError": 408, "RateLimitError": 429}


def read_event(endpoint: str, data: str) -> StreamEvent:
    """One `data:` payload of `endpoint`'s stream; ValueError if it is not JSON."""
    if data == "[DONE]":
        return StreamEvent(done=True)
    event = json.loads(data)
    if endpoint == "responses":
        kind = event.get("type")
        if kind == "error":
            return StreamEvent(error=(_STATUS_OF_TYPE.get(event.get("code")),
                                      f"{event.get('code')}: {event.get('message')}"))
        if kind == "response.output_text.delta":
            return StreamEvent(text=event.get("delta") or "")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            resp = event.get("response") or {}
            finish = "length" if kind == "response.incomplete" else "stop" if kind == "response.completed" else None
            return StreamEvent(finish=finish, tokens=(resp.get("usage") or {}).get("output_tokens"), done=True)
        return StreamEvent()
    if "error" in event:
        err = event["error"]
        return StreamEvent(error=(err.get("code"), f"{err.get('type')}: {err.get('message')}"))
    out = StreamEvent(tokens=(event.get("usage") or {}).get("completion_tokens"))
    for choice in event.get("choices") or ():
        piece = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
        out.text += piece or ""
        out.finish = choice.get("finish_reason") or out.finish
    return out


# --- the load ------------------------------------------------------------------------


class Outcome(str, enum.Enum):
    OK = "ok"  # [DONE] after exactly the expected text, every token
    WRONG = "wrong"  # [DONE] after other text, or fewer tokens
    ERROR = "error"  # an HTTP error status, or one in-band error event
    DROPPED = "dropped"  # the connection ended (or was refused) without [DONE] or an error
    HUNG = "hung"  # a read waited past its deadline, or the request past its own
    CLOSED = "closed"  # the client hung up on purpose (a disconnect burst)


@dataclass
class Result:
    index: int
    probe: int
    outcome: Outcome
    started: float  # time.monotonic()
    ended: float
    chunks: int = 0
    status: int | None = None  # the HTTP status, or the code of the in-band error
    detail: str = ""
    first_chunk: float | None = None  # time.monotonic() of its first text chunk
    max_gap_s: float = 0.0  # its longest wait for a text chunk: from its send to the first, then between two
    replica: str | None = None  # x-pdserve-replica: the gateway replica that answered (None: no answer came)
    endpoint: str = "completions"  # where it was sent (its probe's)


@dataclass
class Load:
    """N clients over `probes` (request i asks probe (offset + i) % len(probes))."""

    probes: Sequence[Probe]
    requests: int
    concurrency: int
    offset: int = 0
    read_timeout_s: float = 30.0  # no byte for this long: hung
    # A client whose request failed waits this long before its next (as a client
    # that retries would): the load spans an outage instead of failing through it.
    pause_after_error_s: float = 0.5
    deadline_s: float = 90.0  # the whole request, from its send (> the server's --request-timeout)
    # (h): these requests hang up at the first chunk after `hang_up` is set.
    hang_up_if: Callable[[int], bool] | None = None
    hang_up: asyncio.Event | None = None
    # Extra streams started with the load, not checked against a probe unless `check_long`
    # ((c)'s are expected to be cut: still running when the gateway dies).
    long_streams: Sequence[Probe] = ()
    check_long: bool = False  # hold the long streams to their probes' text too (probes with an oracle)
    chunks: int = 0  # text chunks streamed so far (each one token or more), all requests
    on_chunk: Callable[[int], None] | None = None  # called with the running total
    # The requests answered and not yet ended, by the gateway replica answering each (request index -> rank).
    in_flight: dict[int, str | None] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None

    def hang_up_now(self) -> None:
        """Start the disconnect burst (from any thread)."""
        if self.hang_up is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.hang_up.set)

    async def run(self, url: str) -> list[Result]:
        self._loop = asyncio.get_running_loop()
        limits = httpx.Limits(max_connections=self.concurrency + len(self.long_streams) + 4)
        timeout = httpx.Timeout(connect=5.0, read=self.read_timeout_s, write=5.0, pool=self.deadline_s)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(self.requests):
                queue.put_nowait(i)
            results: list[Result] = []

            async def worker() -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    p = (self.offset + i) % len(self.probes)
                    res = await self.one(client, i, p, self.probes[p])
                    results.append(res)
                    if res.outcome in (Outcome.ERROR, Outcome.DROPPED):
                        await asyncio.sleep(self.pause_after_error_s)

            longs = [asyncio.create_task(self.one(client, -1 - j, -1, probe, check=self.check_long))
                     for j, probe in enumerate(self.long_streams)]
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
            results += await asyncio.gather(*longs)
        return sorted(results, key=lambda r: r.index)

    async def one(self, client: httpx.AsyncClient, index: int, p: int, probe: Probe, check: bool = True) -> Result:
        path, body = request_of(probe)
        res = Result(index, p, Outcome.DROPPED, time.monotonic(), 0.0, endpoint=probe.endpoint)
        last_chunk = res.started
        text: list[str] = []
        finish: str | None = None
        completion_tokens: int | None = None
        done = False
        try:
            async with asyncio.timeout(self.deadline_s):
                async with client.stream("POST", path, json=body) as r:
                    res.status, res.replica = r.status_code, r.headers.get(REPLICA_HEADER)
                    self.in_flight[index] = res.replica
                    if r.status_code != 200:
                        raw = await r.aread()
                        res.outcome, res.detail = Outcome.ERROR, _error_text(raw)
                        return res
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        ev = read_event(probe.endpoint, line[5:].strip())
                        if ev.error is not None:
                            res.outcome, (res.status, res.detail) = Outcome.ERROR, ev.error
                            return res
                        completion_tokens = ev.tokens if ev.tokens is not None else completion_tokens
                        finish = ev.finish or finish
                        if ev.text:
                            text.append(ev.text)
                            res.chunks += 1
                            self.chunks += 1
                            now = time.monotonic()
                            res.max_gap_s, last_chunk = max(res.max_gap_s, now - last_chunk), now
                            if res.first_chunk is None:
                                res.first_chunk = time.monotonic()
                            if self.on_chunk is not None:
                                self.on_chunk(self.chunks)
                        if ev.done:
                            done = True
                            break
                        if (self.hang_up is not None and self.hang_up.is_set() and self.hang_up_if is not None
                                and self.hang_up_if(index)):
                            res.outcome = Outcome.CLOSED
                            return res  # leaving the block closes the stream mid-way
            if not done:
                res.outcome, res.detail = Outcome.DROPPED, f"stream ended after {res.chunks} chunks without [DONE]"
            elif not check:
                res.outcome = Outcome.OK
            else:
                got = "".join(text)
                if got == probe.text and finish == "length" and completion_tokens == probe.max_tokens:
                    res.outcome = Outcome.OK
                else:
                    res.outcome = Outcome.WRONG
                    res.detail = (f"{len(got)} chars (expected {len(probe.text)}), finish {finish}, "
                                  f"{completion_tokens} tokens (expected {probe.max_tokens}); first difference at "
                                  f"char {_first_difference(got, probe.text)}")
        except (httpx.ReadTimeout, TimeoutError):
            res.outcome = Outcome.HUNG
            res.detail = f"no byte for {self.read_timeout_s:g} s, or past {self.deadline_s:g} s"
        except (httpx.TransportError, httpx.StreamError) as e:
            res.outcome, res.detail = Outcome.DROPPED, f"{type(e).__name__}: {e}"
        except ValueError as e:  # a line that is not JSON: as bad as a wrong answer
            res.outcome, res.detail = Outcome.WRONG, f"bad event: {e}"
        finally:
            res.ended = time.monotonic()
            self.in_flight.pop(index, None)
        return res


# --- /health, watched -----------------------------------------------------------------


@dataclass(frozen=True)
class HealthSample:
    at: float  # time.monotonic() of the send
    status: int | None  # None: no answer (refused, reset, or past the timeout)
    replica: str | None  # x-pdserve-replica of the answer
    took_s: float
    detail: str = ""


class HealthWatch:
    """GET /health every `every_s`, each on a connection of its own (as a load balancer's
    probe: each is balanced anew over the gateway replicas), in a thread, from `start`
    until `stop` or `max_s` after the start."""

    def __init__(self, url: str, every_s: float = 0.1, timeout_s: float = 5.0, max_s: float = 600.0) -> None:
        self.url, self.every_s, self.timeout_s, self.max_s = url, every_s, timeout_s, max_s
        self.samples: list[HealthSample] = []
        self._stop, self._first = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)

    def start(self, first_within_s: float = 10.0) -> HealthWatch:
        """Start polling; return once the first answer (or failure) is in, or `first_within_s` passed."""
        self._thread.start()
        self._first.wait(first_within_s)
        return self

    def stop(self) -> list[HealthSample]:
        self._stop.set()
        self._thread.join(self.timeout_s + 1.0)
        return list(self.samples)

    def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        deadline = time.monotonic() + self.max_s
        with httpx.Client(timeout=self.timeout_s, limits=limits, trust_env=False) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    r = client.get(f"{self.url}/health")
                    sample = HealthSample(t, r.status_code, r.headers.get(REPLICA_HEADER), time.monotonic() - t,
                                          "" if r.status_code == 200 else r.text[:200])
                except httpx.HTTPError as e:
                    sample = HealthSample(t, None, None, time.monotonic() - t, f"{type(e).__name__}: {e}")
                self.samples.append(sample)
                self._first.set()
                self._stop.wait(max(0.0, t + self.every_s - time.monotonic()))


def _error_text(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return f"{err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
