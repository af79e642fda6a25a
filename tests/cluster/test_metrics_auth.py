"""GET /metrics: behind a key whenever an API key is set, and parsed and rendered off
the event loop, so that a slow scrape delays no stream."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from factories import FakeBackend, LocalActor

from pdserve.cluster import metrics as metrics_module
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app

WAIT_S = 10.0
WORKER_TEXT = b'# TYPE pdserve:engine_steps counter\npdserve:engine_steps_total{pool="decode",worker="d0"} 3.0\n'


class Worker:
    async def metrics(self) -> bytes:
        return WORKER_TEXT


class Backend(FakeBackend):
    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        return {"pdserve-decode-0": ("decode", LocalActor(Worker()))}


def gateway(**keys: str | None) -> Gateway:
    return Gateway(Backend(), None, GatewayConfig(model_name="m", max_model_len=64, **keys))  # type: ignore[arg-type]


def scrape_statuses(gw: Gateway) -> list[int]:
    """/metrics without a key, with a wrong one, with the API key, with the metrics key."""
    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw") as c:
            return [(await c.get("/metrics", headers=h)).status_code
                    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer api"},
                              {"Authorization": "Bearer scrape"})]

    return asyncio.run(main())


def test_an_api_key_closes_metrics() -> None:
    assert scrape_statuses(gateway(api_key="api")) == [401, 401, 200, 401]  # the API key opens it
    assert scrape_statuses(gateway(api_key="api", metrics_api_key="scrape")) == [401, 401, 200, 200]
    assert scrape_statuses(gateway(metrics_api_key="scrape")) == [401, 401, 401, 200]
    assert scrape_statuses(gateway()) == [200, 200, 200, 200]  # no key at all: open, as before


def test_scrapes_parse_and_render_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parse of the workers' texts is held until /health has been answered: the
    loop serves it meanwhile. On the loop, /health would wait for the scrape."""
    parse, render = metrics_module._parse, metrics_module._render
    threads: dict[str, threading.Thread] = {}
    health_answered = threading.Event()

    def slow_parse(worker: str, text: str) -> Any:
        threads["parse"] = threading.current_thread()
        health_answered.wait(WAIT_S)
        return parse(worker, text)

    def spied_render(sources: Any) -> bytes:
        threads["render"] = threading.current_thread()
        return render(sources)

    monkeypatch.setattr(metrics_module, "_parse", slow_parse)
    monkeypatch.setattr(metrics_module, "_render", spied_render)
    gw = gateway(api_key="api")

    async def main() -> tuple[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=WAIT_S) as c:
            scrape = asyncio.ensure_future(c.get("/metrics", headers={"Authorization": "Bearer api"}))
            health = await c.get("/health")
            first = "scrape" if scrape.done() else "health"
            assert health.status_code == 200
            health_answered.set()
            return first, await scrape

    loop_thread = threading.current_thread()  # asyncio.run's loop runs on this thread
    first, scraped = asyncio.run(main())
    assert first == "health"
    assert scraped.status_code == 200 and 'pdserve:engine_steps_total{pool="decode",worker="d0"} 3.0' in scraped.text
    assert 'pdserve:worker_up{pool="decode",worker="pdserve-decode-0"} 1.0' in scraped.text
    assert threads["parse"] is not loop_thread and threads["render"] is not loop_thread
