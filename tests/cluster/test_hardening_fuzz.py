"""Property-based fuzzing of the gateway's own OpenAPI schema (issue 16) with
schemathesis: requests that fit the schema and requests that do not, sent to
every route over the tiny model's in-process engine. No answer is a 5xx, and
the server is healthy after: /health is 200, nothing is left admitted or in
the engine, every KV block is free, a normal request works.

Bounded to run in seconds on two cores: a short context, small bounds on n and
prompts, and a fixed number of examples per route."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.openai_app import build_app
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

schemathesis = pytest.importorskip("schemathesis")

MODEL = "tiny"
LEN = 64


@pytest.fixture(scope="module")
def served(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[tuple[Gateway, AsyncEngine, Any]]:
    llm = LLM(str(make_model(tiny_spec())), max_model_len=LEN, num_kv_blocks=64, progress=False)
    engine = AsyncEngine(llm.engine).start()
    limits = RequestLimits(max_n=2, max_prompts=2, max_stop=4, max_messages=4, max_logit_bias=4)
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name=MODEL, max_model_len=LEN, max_in_flight=16, limits=limits,
                               request_timeout_s=30))
    yield gw, engine, build_app(gw)
    engine.close()


def test_no_schema_shaped_or_misshaped_request_gets_a_5xx(served: tuple[Gateway, AsyncEngine, Any]) -> None:
    gw, engine, app = served
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    seen: list[int] = []

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        response = case.call()
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)

    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.method.upper() != "POST" or op.path == "/ping":
            continue  # the GET routes, and /ping's POST (SageMaker's health check), take no input
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            given(case=op.as_strategy(generation_mode=mode))(fuzz)()

    assert 200 in seen and 400 in seen  # both kinds were made
    assert gw.admitted == 0 and engine.healthy
    assert _settled(engine), (engine.num_in_flight, engine.engine.kv.pool.num_used)
    client = TestClient(app)  # (no lifespan: schemathesis holds the app's)
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def _settled(engine: AsyncEngine, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.num_in_flight and not engine.engine.kv.pool.num_used:
            return True
        time.sleep(0.05)
    return False
