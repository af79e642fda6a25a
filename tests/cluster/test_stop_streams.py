"""The end of a stop's drain: what a gateway still holds then ends with an error the client
reads (a stream's error event and `[DONE]`, a 503 otherwise), aborted on its workers, instead
of a connection cut by the processes' shutdown with nothing said (cluster/drain_flag.py
`STOP_STREAMS_AFTER_S`, `GenerationBackend.stop_all`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from factories import FakeBackend, tiny_spec
from test_migration import GREEDY, PROMPTS, disaggregated, offline

from pdserve.cluster.backend_api import ServerStoppingError
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    from test_migration import _services

    yield
    while _services:
        _services.pop().close()


def test_stop_all_ends_every_stream_with_an_error_and_frees_both_sides(model_dir: Path) -> None:
    """Eight requests mid-stream over a prefill and two decode workers: `stop_all` ends each
    with ServerStoppingError after the tokens already sent (a prefix of the offline output),
    a later request gets it at once, and no worker keeps a request, a block or a pending
    handoff."""
    params = [dataclasses.replace(GREEDY, max_tokens=400) for _ in PROMPTS]
    backend, actors = disaggregated(model_dir)

    async def main() -> tuple[list[list[int]], list[BaseException | None], BaseException | None]:
        got: list[list[int]] = [[] for _ in PROMPTS]
        ends: list[BaseException | None] = [None] * len(PROMPTS)

        async def one(i: int) -> None:
            try:
                async for out in backend.generate(f"r{i}", PROMPTS[i], params[i], 60):
                    got[i] += out.outputs[0].token_ids
            except Exception as e:  # noqa: BLE001 - what the test looks at
                ends[i] = e

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
        async with asyncio.timeout(60):
            while sum(len(g) > 0 for g in got) < len(PROMPTS):
                await asyncio.sleep(0.005)
            backend.stop_all()
            await asyncio.gather(*tasks)
        later: BaseException | None = None
        try:
            async for _ in backend.generate("late", PROMPTS[0], params[0], 60):
                pass
        except ServerStoppingError as e:
            later = e
        # The aborts are sent, not awaited: give the workers a bounded moment to run them.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                a.service.engine.has_unfinished_requests() for a in actors.values()):
            await asyncio.sleep(0.02)
        await backend.close()
        return got, ends, later

    got, ends, later = asyncio.run(main())
    assert all(isinstance(e, ServerStoppingError) for e in ends), ends
    assert isinstance(later, ServerStoppingError)
    want = offline(model_dir, params)
    assert all(0 < len(g) < 400 and g == w[: len(g)] for g, w in zip(got, want))
    for name, actor in actors.items():
        engine = actor.service.engine
        assert not engine.has_unfinished_requests(), name
        assert engine.kv.pool.num_used == 0, name  # (the prefix cache's blocks are free to take)
    for name in ("d0", "d1"):
        assert actors[name].service.receiver.num_registered == 0, name


class _EndlessBackend(FakeBackend):
    """A token every 20 ms until told to stop (`stop_all`), then ServerStoppingError."""

    async def generate(self, request_id, prompt, params, timeout_s):  # noqa: ANN001, ANN201
        while True:
            if self.stopped:
                raise ServerStoppingError
            await asyncio.sleep(0.02)
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7])], finished=False)


def test_a_gateway_at_the_end_of_its_drain_ends_what_it_holds_with_an_error_the_client_reads(
        model_dir: Path) -> None:
    """A streamed and a whole-response request still running when the drain's time is up: the
    stream gets its tokens, then an error event (503, "shutting down") and `[DONE]`; the other a
    503 with Retry-After; the in-flight count is back to 0 (the driver's drain sees it and stops)."""
    from transformers import AutoTokenizer

    gw = Gateway(_EndlessBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name=MODEL, max_model_len=256, max_in_flight=8))
    app = build_app(gw)

    async def main() -> tuple[httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 200}
            whole = asyncio.create_task(c.post("/v1/completions", json=body))
            streamed = asyncio.create_task(c.post("/v1/completions", json={**body, "stream": True}))
            await asyncio.sleep(0.2)  # both admitted and generating
            t0 = time.monotonic()
            gw.drain(stop_after_s=0.3)
            async with asyncio.timeout(10):
                done = await whole, await streamed
            took = time.monotonic() - t0
        await gw.close()
        return *done, took

    whole, streamed, took = asyncio.run(main())
    assert 0.3 <= took < 5
    assert whole.status_code == 503 and whole.headers["retry-after"] == "1"
    assert "shutting down" in whole.json()["error"]["message"]
    assert streamed.status_code == 200
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all(c["choices"][0]["text"] == "x" for c in chunks)
    assert gw.admitted == 0


def test_the_gateway_ends_what_it_holds_before_the_drain_ends() -> None:
    """The gateway reads the flag at most SEEN_WITHIN_S after it went up, and must have ended its
    streams, with room to spare, before the driver's drain stops the processes at DRAIN_S."""
    from pdserve.cluster import drain_flag, shutdown

    assert drain_flag.SEEN_WITHIN_S + drain_flag.STOP_STREAMS_AFTER_S <= shutdown.DRAIN_S - 0.5
    assert drain_flag.STOP_STREAMS_AFTER_S >= 0.5 * shutdown.DRAIN_S  # most of the drain is for finishing
