"""Hostile clients at the socket (issue 16): a body too large or too slow, slow
headers, a stream client that stops reading, a request with no key; and what
a client may learn from an error (nothing internal) and where keys come from.
The gateway runs under uvicorn on 127.0.0.1 over a fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, serve_gateway, serve_in_process, sse_error_code, tiny_spec
from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.router import NoHealthyWorkerError
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"
KEY = {"Authorization": "Bearer sekret"}
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


class Backend(FakeBackend):
    """`flood`: a stream of 64 KiB deltas, as fast as the client takes them, until
    aborted; otherwise three tokens at once. `error`: raised instead."""

    def __init__(self) -> None:
        self.flood = False
        self.error: BaseException | None = None
        self.aborted = 0

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise self.error
        try:
            while self.flood:
                await asyncio.sleep(0)
                yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x" * 65536, [7])], finished=False)
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "xyz", [7, 7, 7],
                                                                            finish_reason="length")], finished=True)
        except GeneratorExit:
            self.aborted += 1
            raise


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec()))


def gateway(tokenizer: Any, backend: Any = None, **config: Any) -> Gateway:
    return Gateway(backend or Backend(), tokenizer,
                   GatewayConfig(**{"model_name": MODEL, "max_model_len": 256, "api_key": "sekret", **config}))


def refused(gw: Gateway) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in gw.metrics.refused.collect()[0].samples if s.name.endswith("_total")}


def raw(url: str, head: str, body: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    """A connection that sent `head` (a request line and headers) and `body`, and reads nothing yet."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(head.encode() + body)
    return sock


def status_of(sock: socket.socket, timeout_s: float) -> int:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def head(path: str, length: int, key: str = "sekret", extra: str = "") -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}\r\n")


def normal_request_works(url: str) -> bool:
    return httpx.post(f"{url}/v1/completions", json=OK, headers=KEY, timeout=10).status_code == 200


def test_key_is_checked_before_the_body_and_a_declared_huge_body_is_413_at_once(tokenizer: Any) -> None:
    gw = gateway(tokenizer)
    with serve_gateway(gw) as url:
        # Neither sends a byte of its gigabyte: each is answered from its headers.
        with contextlib.closing(raw(url, head("/v1/completions", 10**9, key="wrong"))) as s:
            assert status_of(s, 5) == 401
        with contextlib.closing(raw(url, head("/v1/completions", 10**9))) as s:
            assert status_of(s, 5) == 413
        assert normal_request_works(url)
    assert refused(gw)["auth"] == 1 and refused(gw)["body_too_large"] == 1


def test_a_body_that_trickles_in_gets_408_and_slow_headers_block_no_one(tokenizer: Any) -> None:
    gw = gateway(tokenizer, limits=RequestLimits(body_timeout=0.5))
    with serve_gateway(gw) as url:
        with contextlib.closing(raw(url, head("/v1/completions", 100), b'{"model": ')) as slow_body, \
                contextlib.closing(raw(url, "POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")) as slow_headers:
            start = time.monotonic()
            for _ in range(3):  # the server serves others meanwhile
                slow_headers.sendall(b"X-A: b\r\n")
                assert normal_request_works(url)
            assert status_of(slow_body, 5) == 408
            assert 0.4 < time.monotonic() - start < 5
        assert normal_request_works(url)
    assert refused(gw)["body_timeout"] == 1


def test_a_stream_client_that_stops_reading_is_dropped_and_frees_its_slot(tokenizer: Any) -> None:
    backend = Backend()
    backend.flood = True
    gw = gateway(tokenizer, backend, max_in_flight=1, limits=RequestLimits(write_timeout=0.5))
    body = b'{"model": "tiny", "prompt": "hi", "stream": true, "max_tokens": 100}'
    with serve_gateway(gw) as url, contextlib.closing(raw(url, head("/v1/completions", len(body)), body, rcvbuf=4096)):
        deadline = time.monotonic() + 5
        while not gw.admitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gw.admitted == 1  # the slot is held while the stream runs
        deadline = time.monotonic() + 10
        while (gw.admitted or not backend.aborted) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gw.admitted == 0 and backend.aborted == 1  # dropped: slot free, request aborted
        backend.flood = False  # (the next request finishes at once)
        assert normal_request_works(url)
    assert refused(gw)["write_timeout"] == 1


class _Slow(FakeBackend):
    """Five tokens, `gap_s` apart: a stream that lasts longer than its writes."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        for i in range(5):
            await asyncio.sleep(self.gap_s)
            yield RequestOutput(request_id, None, prompt,
                                [CompletionOutput(0, "x", [7], finish_reason="length" if i == 4 else None)],
                                finished=i == 4)


def test_the_write_timeout_times_each_write_not_the_stream(tokenizer: Any) -> None:
    """A client that reads every chunk at once is never dropped, however long its stream
    takes between tokens (1.5 s here, three write timeouts)."""
    gw = gateway(tokenizer, _Slow(gap_s=0.3), limits=RequestLimits(write_timeout=0.5))
    with serve_gateway(gw) as url:
        with httpx.stream("POST", f"{url}/v1/completions", headers=KEY, timeout=10,
                          json={**OK, "stream": True, "max_tokens": 5}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["x"] * 5
    assert refused(gw).get("write_timeout", 0) == 0


def test_no_write_timer_outlives_its_response(tokenizer: Any) -> None:
    """Refused requests (a bad key: the guard writes the error) and served ones leave no
    write-timeout timer behind on the event loop: a stream of bad keys must not pile them up."""
    gw = gateway(tokenizer, Backend(), limits=RequestLimits(write_timeout=0.5))

    def watch_timers() -> list[asyncio.TimerHandle]:
        scheduled = asyncio.get_running_loop()._scheduled  # type: ignore[attr-defined]
        return [h for h in scheduled if not h.cancelled() and "_WriteWatch" in repr(h)]

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            codes = [(await c.post("/v1/completions", json=OK, headers={"Authorization": "Bearer no"})).status_code
                     for _ in range(5)]
            codes.append((await c.post("/v1/completions", json={**OK, "stream": True}, headers=KEY)).status_code)
            assert watch_timers() == []
            return codes

    assert asyncio.run(main()) == [401] * 5 + [200]


class _Errors:
    """Errors a backend may raise, as the cluster's backends see them."""

    @staticmethod
    def ray_task(cause: Exception) -> Exception:
        trace = ('Traceback (most recent call last):\n  File "/home/ops/pdserve/workers/engine.py", line 386\n'
                 f"{type(cause).__name__}: {cause}")
        return RayTaskError("DecodeService.serve", trace, cause, pid=4242, ip="10.1.2.3",
                            actor_id="f00dfeedbeef").as_instanceof_cause()


INTERNALS = ("pid", "4242", "10.1.2.3", "f00dfeedbeef", "/home/ops", "Traceback", "DecodeService")


@pytest.mark.parametrize(("error", "status"), [
    (_Errors.ray_task(ValueError("logit_bias: token id 99999 is not in the vocabulary [0, 4096)")), 400),
    (_Errors.ray_task(RuntimeError("CUDA error: an illegal memory access at /home/ops")), 500),
    (RayActorError(actor_id="f00dfeedbeef", error_msg="The actor died (pid=4242, ip=10.1.2.3)"), 500),
    (RuntimeError("engine thread died in /home/ops/pdserve/workers/engine.py (pid 4242)"), 500),
    (NoHealthyWorkerError("decode pool: DecodeService f00dfeedbeef at 10.1.2.3 is down"), 503),
    (TimeoutError("request cmpl-1 at 10.1.2.3 (pid=4242) timed out"), 504),
])
def test_errors_carry_a_message_a_type_and_the_request_id_never_internals(
        tokenizer: Any, caplog: pytest.LogCaptureFixture, error: Exception, status: int) -> None:
    backend = Backend()
    backend.error = error
    gw = gateway(tokenizer, backend)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            return (await c.post("/v1/completions", json=OK, headers=KEY),
                    await c.post("/v1/completions", json={**OK, "stream": True}, headers=KEY))

    with caplog.at_level(logging.INFO, logger="pdserve"):
        whole, stream = asyncio.run(main())
    rid = whole.headers["x-request-id"]
    assert whole.status_code == status and whole.json()["error"]["code"] == status
    assert stream.status_code == 200 and sse_error_code(stream.text) == status  # in-band, the status line was sent
    for text in (whole.text, stream.text):
        # Request ids are random hex, which can hold "4242" by chance (CI, af04be5): not internals.
        text = re.sub(r"\b(?:[a-z]+-)?[0-9a-f]{32}\b", "<request id>", text)
        assert not [word for word in INTERNALS if word in text], text
    if status == 400:
        assert whole.json()["error"]["param"] == "logit_bias"
    if status == 500:
        assert rid in whole.json()["error"]["message"]  # what to quote to the operator
        assert rid in caplog.text  # ... who finds the details under it
    if status == 503:
        assert whole.headers["retry-after"] == "1"


@pytest.mark.parametrize("server_writes", [False, True], ids=["own-header", "server-writes-it"])
def test_a_clients_request_id_names_its_request_and_a_reused_one_stays_apart(tokenizer: Any,
                                                                             server_writes: bool) -> None:
    """A client's x-request-id comes back, once, and begins the id the log and the body name the
    request by; a client that sends one id twice at once gets two requests, not a clash in the
    engines. Unusable as an id (a space, 65 characters): a fresh one. Behind Ray Serve (its
    ingress writes the header itself) the gateway wrote a second header with another id."""
    gw = gateway(tokenizer, server_writes_request_id=server_writes)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            sent = [{"x-request-id": "job-1"}, {"x-request-id": "job-1"}, {"x-request-id": "a b"},
                    {"x-request-id": "x" * 65}, {}]
            return list(await asyncio.gather(*(c.post("/v1/completions", json=OK, headers={**KEY, **h})
                                               for h in sent)))

    rs = asyncio.run(main())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    ids = [r.json()["id"] for r in rs]
    assert ids[0] != ids[1] and all(re.fullmatch(r"cmpl-job-1-[0-9a-f]{8}", i) for i in ids[:2]), ids
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids[2:]), ids
    headers = [r.headers.get_list("x-request-id") for r in rs]
    if server_writes:
        assert headers == [[]] * 5
    else:
        assert headers[:2] == [["job-1"]] * 2 and [h for [h] in headers[2:]] == [i[5:] for i in ids[2:]]


def test_every_503_says_when_to_retry(tokenizer: Any) -> None:
    backend = Backend()
    backend.healthy = False  # type: ignore[misc]
    gw = gateway(tokenizer, backend)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            return await c.post("/v1/completions", json=OK, headers=KEY), await c.get("/health")

    admission, health = asyncio.run(main())
    for r in (admission, health):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert refused(gw)["unavailable"] == 1


def test_docs_and_metrics_behind_their_keys(tokenizer: Any) -> None:
    async def main(gw: Gateway) -> dict[str, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            out = {}
            for path in ("/docs", "/openapi.json", "/redoc", "/metrics", "/health", "/ping", "/version", "/v1/models",
                         "/nowhere"):
                out[path] = [(await c.get(path, headers=h)).status_code for h in
                             ({}, KEY, {"Authorization": "Bearer scrape"})]
            return out

    keyed = asyncio.run(main(gateway(tokenizer, metrics_api_key="scrape")))
    assert keyed == {"/docs": [401, 200, 401], "/openapi.json": [401, 200, 401], "/redoc": [401, 200, 401],
                     "/metrics": [401, 200, 200], "/health": [200, 200, 200], "/v1/models": [401, 200, 401],
                     # vLLM's /ping (SageMaker's health check) is open as /health is; /version behind the key
                     "/ping": [200, 200, 200], "/version": [401, 200, 401],
                     "/nowhere": [401, 404, 401]}
    # No metrics key: the API key opens it (an API key never leaves it open); no key at all: open.
    assert asyncio.run(main(gateway(tokenizer)))["/metrics"] == [401, 200, 401]
    assert asyncio.run(main(gateway(tokenizer, api_key=None)))["/metrics"] == [200, 200, 200]
    assert asyncio.run(main(gateway(tokenizer, api_key=None)))["/docs"] == [200, 200, 200]  # no key at all
    # vLLM's --disable-fastapi-docs: none of the three, even with the key; the API still answers
    off = asyncio.run(main(gateway(tokenizer, fastapi_docs=False)))
    assert [off[p][1] for p in ("/docs", "/openapi.json", "/redoc", "/v1/models")] == [404, 404, 404, 200]


def test_vllms_ping_and_version(tokenizer: Any) -> None:
    """vLLM's /ping answers as /health (GET or POST: SageMaker posts); /version names the server's."""
    import pdserve

    async def main(gw: Gateway) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            return [await c.get("/health"), await c.get("/ping"), await c.post("/ping"), await c.get("/version")]

    health, get, post, version = asyncio.run(main(gateway(tokenizer, api_key=None)))
    assert get.status_code == post.status_code == health.status_code == 200
    assert get.json() == post.json() == health.json()
    assert version.json() == {"version": pdserve.__version__}


def test_keys_come_from_files_or_the_environment_and_never_show(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cluster.cli import build_parser
    from pdserve.cluster.serve_app import gateway_config
    from pdserve.cluster.serve_config import serve_config

    seen: list[Any] = []
    serve_in_process(monkeypatch)
    monkeypatch.setattr("pdserve.cluster.serve_app.run", lambda cfg: seen.append(cfg))
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file-0123\n")
    monkeypatch.setenv("PDSERVE_METRICS_API_KEY", "sk-metrics-env-4567")
    args = build_parser().parse_args(["serve", "--model", "tiny", "--api-key-file", str(key_file), "--max-n", "4",
                                      "--write-timeout", "2.5"])
    assert args.func(args) == 0
    (cfg,) = seen
    assert (cfg.api_key, cfg.metrics_api_key) == ("sk-from-file-0123", "sk-metrics-env-4567")
    assert cfg.limits.max_n == 4 and cfg.limits.write_timeout == 2.5
    gw_cfg = gateway_config(cfg, 256, "/m")
    assert gw_cfg.api_key == cfg.api_key and gw_cfg.limits == cfg.limits
    for shown in (repr(cfg), str(cfg), repr(gw_cfg)):
        assert "sk-" not in shown

    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env-89")
    seen.clear()
    args = build_parser().parse_args(["serve", "--model", "tiny"])
    args.func(args)
    assert seen[0].api_key == "sk-env-89"
    key_file.write_text("  \n")
    with pytest.raises(ValueError, match="^api_key_file: .* is empty"):
        args = build_parser().parse_args(["serve", "--model", "tiny", "--api-key-file", str(key_file)])
        args.func(args)
    with pytest.raises(ValueError, match="^max_n: must be > 0, got 0"):
        serve_config({"model": "tiny", "max_n": 0})


@pytest.mark.parametrize("name", ["api_key", "metrics_api_key"])
def test_a_key_no_client_can_send_is_refused_at_start(tokenizer: Any, name: str) -> None:
    """A key is sent in a header: printable ASCII. A non-ASCII key (a key file's "é") was
    taken, and then no client could present it (the OpenAI SDK cannot send it; curl's UTF-8
    bytes are read as Latin-1 and never match): every request a 401. Refused at start,
    naming the setting and never showing the key."""
    from pdserve.cluster.serve_config import serve_config

    gw = gateway(tokenizer, api_key="sk-clé")

    async def curl_like() -> int:  # the key as curl sends it: its UTF-8 bytes
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            return (await c.get("/v1/models", headers={"Authorization": "Bearer sk-clé".encode()})).status_code

    assert asyncio.run(curl_like()) == 401  # what such a key gets: no client is let in
    for key in ("sk-clé", "sk-\u00a0x", "sk-\x00x"):
        with pytest.raises(ValueError, match=f"^{name}: ") as e:
            serve_config({"model": "tiny", name: key})
        assert "sk-" not in str(e.value)
    assert serve_config({"model": "tiny", name: "sk-A.b_c~d+e/f=0"}) is not None


def test_overlapping_scrapes_ask_each_worker_once(tokenizer: Any) -> None:
    """/metrics fans out to every worker: ten scrapes at once cost each worker one."""
    from factories import LocalActor

    class Worker:
        calls = 0

        async def metrics(self) -> bytes:
            Worker.calls += 1
            await asyncio.sleep(0.2)
            return b""

    class WithWorkers(Backend):
        def worker_handles(self) -> dict[str, tuple[str, Any]]:
            return {"pdserve-decode-0": ("decode", LocalActor(Worker()))}

    gw = gateway(tokenizer, WithWorkers())

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            together = await asyncio.gather(*(c.get("/metrics", headers=KEY) for _ in range(10)))
            return [*together, await c.get("/metrics", headers=KEY)]

    responses = asyncio.run(main())
    assert all(r.status_code == 200 and "pdserve:worker_up" in r.text for r in responses)
    assert Worker.calls == 2  # one for the ten, one for the scrape after them
