"""Edge cases of the gateway's metrics an operator's SLO dashboards and alerts rely on:
counters that never go backwards within a series, whichever gateway replica a scrape reaches."""

from __future__ import annotations

import asyncio
import json
import time

from metrics_store import Store, by_replica
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import metrics_peers
from pdserve.cluster.metrics import GatewayMetrics, _render


def test_a_counter_never_goes_back_when_scrapes_alternate_between_replicas() -> None:
    """HAProxy sends consecutive scrapes to different replicas. Replica 0's series must read the
    same or more on each: a drop is a counter reset to rate(), which then counts the whole
    counter again (a spike of invented traffic on the dashboard, alerts on it)."""
    store = Store()
    tier = [GatewayMetrics(replica=r, replicas=2) for r in range(2)]
    for m in tier:
        m.peers = store
    m0, m1 = tier

    async def scrapes() -> list[float]:
        # Replica 0's publisher ran a moment ago (as it does every PUBLISH_S) ...
        store.put(0, metrics_peers.pack(_render([m0.own_families()]), time.time()))
        m0.prompt_tokens.inc(3)  # ... then it admitted a request.
        seen = []
        for m in (m0, m1, m0, m1):  # Prometheus, through HAProxy, one scrape after the other
            seen.append(by_replica(await m.exposition({}), "pdserve:prompt_tokens_total")["0"])
        return seen

    seen = asyncio.run(scrapes())
    assert seen[0] == 3.0
    assert all(a <= b for a, b in zip(seen, seen[1:])), f"replica 0's counter went back: {seen}"


# -- every exit path of a request, counted once ------------------------------------------

from collections.abc import AsyncIterator, Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
from factories import FakeBackend, tiny_spec  # noqa: E402

from pdserve.cluster.gateway import Gateway, GatewayConfig  # noqa: E402
from pdserve.cluster.openai_app import build_app  # noqa: E402
from pdserve.workers.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pdserve.workers.sampling_params import SamplingParams  # noqa: E402
from pdserve.workers.tiny.builder import TinyModelSpec  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2)))


class SlowBackend(FakeBackend):
    """One token every `gap` seconds, `tokens` of them, then "length"."""

    def __init__(self, tokens: int = 50, gap: float = 0.02) -> None:
        self.tokens, self.gap = tokens, gap

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        for i in range(self.tokens):
            await asyncio.sleep(self.gap)
            last = i == self.tokens - 1
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7],
                                                                            finish_reason="length" if last else None)],
                                finished=last)


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _values(fams: dict[str, Any], family: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in fams[family].samples if s.name.endswith("_total")}


def _value(fams: dict[str, Any], name: str) -> float:
    family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    (s,) = [s for s in fams[family].samples if s.name == name]
    return float(s.value)


async def _drive(app: Any, body: dict[str, Any], disconnect_after_chunks: int) -> list[dict[str, Any]]:
    """POST `body` to /v1/completions as a raw ASGI client that disconnects once it has
    `disconnect_after_chunks` body chunks (a client closing its connection mid-response)."""

    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent = False
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            if not disconnect_after_chunks:
                gone.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        chunks = [m for m in messages if m["type"] == "http.response.body" and m.get("body")]
        if len(chunks) >= disconnect_after_chunks:
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"gw")],
             "client": ("127.0.0.1", 1), "server": ("gw", 80)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return messages


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_request_is_one_499_and_no_success(tokenizer: Any, stream: bool) -> None:
    gw = Gateway(SlowBackend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> dict[str, Any]:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 50, "stream": stream}
        # Streamed: gone after 3 chunks. Not streamed: gone at once (no chunk comes before the end).
        await _drive(app, body, 3 if stream else 0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return _families((await c.get("/metrics")).text)

    f = asyncio.run(main())
    errors = _values(f, "pdserve:request_errors", "code")
    assert errors["499"] == 1 and sum(errors.values()) == 1, errors
    assert sum(_values(f, "pdserve:request_success", "finished_reason").values()) == 0
    assert _value(f, "pdserve:num_requests_in_flight") == _value(f, "pdserve:num_requests_queued") == 0


def test_an_admission_refusal_is_one_429_and_one_capacity_refusal(tokenizer: Any) -> None:
    gw = Gateway(SlowBackend(tokens=10), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256,
                                                                  max_in_flight=1))
    app = build_app(gw)

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 10}
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.05)
            assert (await c.post("/v1/completions", json=body)).status_code == 429
            assert (await first).status_code == 200
            return _families((await c.get("/metrics")).text)

    f = asyncio.run(main())
    errors = _values(f, "pdserve:request_errors", "code")
    assert errors["429"] == 1 and sum(errors.values()) == 1, errors
    assert _values(f, "pdserve:requests_refused", "reason")["capacity"] == 1
    assert _values(f, "pdserve:request_success", "finished_reason")["length"] == 1
    assert _value(f, "pdserve:num_requests_in_flight") == _value(f, "pdserve:num_requests_queued") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_and_generation_lengths_are_observed_per_choice_alike(tokenizer: Any, stream: bool) -> None:
    """Two prompts (3 and 5 tokens), n = 2: four engine requests, four finished choices.
    `request_generation_tokens` has one observation per choice; `request_prompt_tokens` must
    too, each of its own prompt's length: the planner (cluster/planner/traffic.py) takes the
    prompt histogram's count as the requests that finished and draws each one's prompt and
    output length from the two histograms. One observation of 8 tokens read as one request
    with an 8-token prompt, at a quarter of the rate the engines saw."""
    gw = Gateway(SlowBackend(tokens=3, gap=0.001), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": [[5, 6, 7], [5, 6, 7, 8, 9]], "max_tokens": 3, "n": 2,
                    "stream": stream}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            return _families((await c.get("/metrics")).text)

    f = asyncio.run(main())
    assert sum(_values(f, "pdserve:request_success", "finished_reason").values()) == 4
    assert _value(f, "pdserve:request_generation_tokens_count") == 4
    assert _value(f, "pdserve:request_prompt_tokens_count") == 4
    assert _value(f, "pdserve:request_prompt_tokens_sum") == 2 * 3 + 2 * 5
    buckets = {s.labels["le"]: s.value for s in f["pdserve:request_prompt_tokens"].samples
               if s.name.endswith("_bucket")}
    assert buckets["2.0"] == 0 and buckets["5.0"] == 4  # 3, 3, 5, 5: none of 8


def test_a_client_gone_while_sending_its_body_is_a_499_not_a_server_error(tokenizer: Any) -> None:
    """A client that hangs up before its body is all sent gets no answer. The request counter
    counted it as a 500 (its status before any response), which a 5xx alert reads as the
    server failing."""
    gw = Gateway(SlowBackend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)
    sent: list[dict[str, Any]] = []

    async def main() -> dict[str, Any]:
        parts = iter([{"type": "http.request", "body": b'{"model": "tiny", ', "more_body": True}])

        async def receive() -> dict[str, Any]:
            return next(parts, {"type": "http.disconnect"})

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"gw")],
                 "client": ("127.0.0.1", 1), "server": ("gw", 80)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return _families((await c.get("/metrics")).text)

    f = asyncio.run(main())
    assert sent == []
    statuses = {(s.labels["endpoint"], s.labels["status"]): s.value for s in f["pdserve:gateway_requests"].samples
                if s.name.endswith("_total") and s.value and s.labels["endpoint"] != "/metrics"}
    assert statuses == {("/v1/completions", "499"): 1}, statuses
    errors = _values(f, "pdserve:request_errors", "code")
    assert errors["499"] == 1 and sum(errors.values()) == 1, errors


def test_an_app_that_fails_before_answering_is_counted_a_500() -> None:
    """The other side of the 499: an exception before any response is the server's."""
    from prometheus_client import CollectorRegistry, Counter

    from pdserve.cluster.metrics import RequestCounter

    counter = Counter("requests", "", ["endpoint", "status"], registry=CollectorRegistry())

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        with pytest.raises(RuntimeError):
            await RequestCounter(broken, counter, frozenset({"/x"}))({"type": "http", "path": "/x"}, None, None)

    asyncio.run(main())
    assert counter.labels("/x", "500")._value.get() == 1


class QueuedBackend(SlowBackend):
    """SlowBackend's tokens, each engine request's first output carrying its queue time."""

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        first = True
        async for out in super().generate(request_id, prompt, params, timeout_s):
            if first:
                out.metrics["queue_time_s"] = 0.03
                first = False
            yield out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_token_counts_match_usage_and_queue_time_is_per_choice(tokenizer: Any, stream: bool) -> None:
    """generation_tokens_total is what `usage` says the clients got: an echo with max_tokens 0
    sends none of the token its engine request makes. Queue time is one observation per choice
    (vLLM's: per engine request), as TTFT is."""
    gw = Gateway(QueuedBackend(tokens=3, gap=0.001), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            completion_tokens = 0
            for body in ({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 0, "echo": True},
                         {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "n": 2}):
                r = await c.post("/v1/completions", json={**body, "stream": stream,
                                                          **({"stream_options": {"include_usage": True}}
                                                             if stream else {})})
                assert r.status_code == 200, r.text
                usage = (json.loads(r.text.split("data: ")[-2]) if stream else r.json())["usage"]
                completion_tokens += usage["completion_tokens"]
            return completion_tokens, _families((await c.get("/metrics")).text)

    completion_tokens, f = asyncio.run(main())
    assert completion_tokens == 6
    assert _value(f, "pdserve:generation_tokens_total") == 6
    assert _value(f, "pdserve:request_generation_tokens_sum") == 6
    assert _value(f, "pdserve:request_queue_time_seconds_count") == 3  # 1 + 2 choices
    assert _value(f, "pdserve:time_to_first_token_seconds_count") == 2  # the echo's choice sent no token
