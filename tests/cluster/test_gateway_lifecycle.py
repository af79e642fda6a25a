"""The gateway's admission and lifecycle over real HTTP (uvicorn on loopback), with a backend
that streams slowly: the bound on requests in flight (429 with Retry-After), a stop that
finishes what it has and takes nothing new, a request still tokenizing counted in flight for
the stop's drain, the engine call's deadline, and the replica each response names."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, tiny_spec

from pdserve import LLM
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


class _SlowBackend(FakeBackend):
    """Streams one token per 50 ms, forever unless aborted: holds admission slots."""

    async def generate(self, request_id, prompt, params, timeout_s):  # noqa: ANN001, ANN201
        import asyncio

        from pdserve.workers.outputs import CompletionOutput, RequestOutput

        for i in range(params.max_tokens):
            await asyncio.sleep(0.05)
            done = i == params.max_tokens - 1
            yield RequestOutput(request_id, None, prompt,
                                [CompletionOutput(0, "x", [7], finish_reason="length" if done else None)],
                                finished=done)


def test_admission_bound_gives_429_with_retry_after(model_dir: Path) -> None:
    import asyncio

    from transformers import AutoTokenizer

    gw = Gateway(_SlowBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name=MODEL, max_model_len=256, max_in_flight=2))
    app = build_app(gw)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 6}
            slow = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.15)  # both admitted and generating
            extra = await c.post("/v1/completions", json=body)
            results = await asyncio.gather(*slow)
            # The bound counts engine requests: one call of 2 prompts x n=2 is four of them.
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.15)
            batch = await c.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2})
            results.append(await first)
            alone = await c.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 2})  # nothing else runs
            return [extra, batch, alone, *results]

    extra, batch, alone, *ok = asyncio.run(main())
    assert extra.status_code == 429 and extra.headers["retry-after"] == "1"
    assert extra.json()["error"]["code"] == 429
    assert batch.status_code == 429
    assert alone.status_code == 200 and len(alone.json()["choices"]) == 4  # bigger than the bound, but alone
    assert [r.status_code for r in ok] == [200, 200, 200]


def test_a_stopping_gateway_finishes_what_it_has_and_takes_nothing_new(model_dir: Path) -> None:
    """`pdserve serve`'s stop raises the drain flag (cluster/drain_flag.py; a flag here stands
    in for Ray's key-value store): the request in flight runs to its end, a new one gets 503
    with Retry-After, and /health says "draining" (503) so a load balancer looks elsewhere."""
    import asyncio
    import threading

    from transformers import AutoTokenizer

    from pdserve.cluster.drain_flag import DrainWatch

    gw = Gateway(_SlowBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name=MODEL, max_model_len=256, max_in_flight=8))
    flag = threading.Event()
    gw.drain_watch = DrainWatch(8000, gw.drain, poll_s=0.01, read=lambda port: flag.is_set())
    app = build_app(gw)

    async def main() -> tuple[httpx.Response, ...]:
        gw.start_planner()  # what the app's startup does (ASGITransport runs no lifespan)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 10}
            healthy = await c.get("/health")
            running = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.15)  # admitted and generating
            flag.set()
            await asyncio.sleep(0.1)  # the watch has read it
            refused = await c.post("/v1/completions", json=body)
            health = await c.get("/health")
            done = await running
        await gw.close()
        return healthy, refused, health, done

    healthy, refused, health, done = asyncio.run(main())
    assert healthy.status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "shutting down" in refused.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == "x" * 10
    assert gw.admitted == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_admitted_and_still_tokenizing_is_in_flight_for_the_stops_drain(model_dir: Path,
                                                                                  stream: bool) -> None:
    """`pdserve serve`'s drain waits while the gateway's `pdserve:num_requests_in_flight` is
    above 0 (cluster/shutdown.py). A request admitted before the stop (past the 503 of a
    draining gateway) but whose prompt was still queued for the tokenizer pool was not counted
    yet: the drain read 0, stopped, and Serve's shutdown cut the request with no response."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families
    from transformers import AutoTokenizer

    gw = Gateway(_SlowBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name=MODEL, max_model_len=256, max_in_flight=8))
    queued, go = asyncio.Event(), asyncio.Event()
    off_loop = gw.off_loop

    async def behind_other_prompts(body: Any, fn: Callable[[], Any]) -> Any:
        queued.set()
        await go.wait()  # the tokenizer pool busy with other prompts
        return await off_loop(body, fn)

    gw.off_loop = behind_other_prompts  # type: ignore[method-assign]
    app = build_app(gw)

    def in_flight(text: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "pdserve:num_requests_in_flight")

    async def main() -> tuple[float, httpx.Response, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream}
            running = asyncio.create_task(c.post("/v1/completions", json=body))
            async with asyncio.timeout(10):
                await queued.wait()
            tokenizing = in_flight((await c.get("/metrics")).text)
            gw.drain()  # the stop: it must wait for this request
            go.set()
            async with asyncio.timeout(10):
                done = await running
            after = in_flight((await c.get("/metrics")).text)
        await gw.close()
        return tokenizing, done, after

    tokenizing, done, after = asyncio.run(main())
    assert tokenizing == 1
    assert done.status_code == 200 and ("[DONE]" in done.text if stream else done.json()["choices"][0]["text"])
    assert after == 0 and gw.admitted == 0


def test_engine_call_has_a_deadline_and_reports_a_dead_engine(model_dir: Path) -> None:
    import asyncio

    from pdserve.workers.async_engine import EngineDeadError

    engine = AsyncEngine(LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).engine).start()

    async def main() -> None:
        assert await engine.call(lambda e: e.num_kv_blocks) == 64
        with pytest.raises(asyncio.TimeoutError):  # the engine thread is busy past the second call's deadline
            await asyncio.gather(engine.call(lambda e: time.sleep(0.3)), engine.call(lambda e: None, timeout_s=0.1))

    asyncio.run(main())
    engine.close()

    async def after() -> None:
        with pytest.raises(EngineDeadError):
            await engine.call(lambda e: None)

    asyncio.run(after())


def test_a_request_can_turn_speculation_off() -> None:
    from pdserve.cluster.protocol import CompletionRequest

    on = CompletionRequest(prompt="hi").sampling_params(4, None)
    off = CompletionRequest(prompt="hi", speculative=False).sampling_params(4, None)
    assert on.speculative and not off.speculative


def test_every_response_names_its_gateway_replica(model_dir: Path) -> None:
    """x-pdserve-replica: the replica's rank on every response (a stream, /health, a 404,
    a refusal by the guard): behind HAProxy, how a client tells which replica served it."""
    import asyncio

    from transformers import AutoTokenizer

    gw = Gateway(_SlowBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name=MODEL, max_model_len=256, replica=3, api_key="k"))

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            auth = {"Authorization": "Bearer k"}
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body, headers=auth) as s:
                events = [line async for line in s.aiter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            return [s, await c.get("/health"), await c.get("/nowhere", headers=auth),
                    await c.post("/v1/completions", json=body)]

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 200, 404, 401]
    assert [r.headers.get("x-pdserve-replica") for r in responses] == ["3"] * 4
    with pytest.raises(ValueError, match="replica"):
        GatewayConfig(model_name=MODEL, max_model_len=256, replica=-1)
