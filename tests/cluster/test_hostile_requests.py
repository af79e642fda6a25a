"""Generated hostile requests against the gateway and a real tiny engine (issue 46,
item 1): over the whole request schema, with the extremes of every numeric field,
every answer is a complete 200 or a 400 naming a field the request sent; and no value
reaches the engine that it cannot take: it fails no request alone (a fault would mean
a value slipped past the checks), and it is healthy and empty after.

bench/hostile_requests.py sends 10,000 of the same against `pdserve serve`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from hostile import encode, judge, requests
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.openai_app import build_app
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

LEN = 64


@pytest.fixture(scope="module")
def served(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[tuple[AsyncEngine, TestClient]]:
    llm = LLM(str(make_model(tiny_spec())), max_model_len=LEN, num_kv_blocks=64, progress=False)
    engine = AsyncEngine(llm.engine).start()
    limits = RequestLimits(max_n=2, max_prompts=2, max_stop=4, max_messages=4, max_logit_bias=4)
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name="tiny", max_model_len=LEN, max_in_flight=16, limits=limits,
                               request_timeout_s=30))
    with TestClient(build_app(gw)) as client:
        yield engine, client
    engine.close()


@pytest.mark.slow
def test_hostile_requests_get_a_whole_answer_or_a_400_naming_a_field(served: tuple[AsyncEngine, TestClient]) -> None:
    engine, client = served
    kinds: Counter[str] = Counter()

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def fuzz(request: tuple[str, dict[str, Any]]) -> None:
        route, body = request
        response = client.post(route, content=encode(body), headers={"content-type": "application/json"})
        verdict = judge(body, response.status_code, response.text)
        assert verdict.ok, (route, body, verdict)
        kinds[verdict.kind] += 1

    fuzz()
    # Both outcomes were exercised: the generator reaches past the checks, and through them.
    assert kinds["answered"] >= 20 and kinds["refused"] >= 100, kinds
    assert engine.healthy and engine.engine.stats.request_faults == 0
    assert engine.num_in_flight == 0 and engine.engine.kv.pool.num_used == 0


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 1e-40), ("temperature", 5e-324), ("top_k", 2**63), ("top_k", 10**30), ("seed", 2**64),
    ("logit_bias", {"9223372036854775808": 1.0}), ("repetition_penalty", 1e-300), ("stop_token_ids", [2**63]),
    ("logprobs", 10**9), ("n", 2**63), ("min_p", float("nan")), ("top_p", float("inf")),
    ("presence_penalty", float("-inf")),
])
def test_the_values_that_killed_a_worker_are_refused_or_served(served: tuple[AsyncEngine, TestClient], field: str,
                                                               value: object) -> None:
    """Each of these is a 400 naming the field, or (a denormal temperature: greedy, as
    vLLM) a whole answer; and the engine serves the next request."""
    engine, client = served
    body = {"prompt": "The capital of France is", "max_tokens": 8, field: value}
    response = client.post("/v1/completions", content=encode(body), headers={"content-type": "application/json"})
    verdict = judge(body, response.status_code, response.text)
    assert verdict.ok, verdict
    if field == "temperature":
        assert verdict.kind == "answered"
        greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
        assert response.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    else:
        assert verdict.kind == "refused" and verdict.detail == field
    assert engine.healthy and engine.engine.stats.request_faults == 0
