"""vLLM's POST /invocations (SageMaker's inference path, beside /ping): a body with `messages` is a
chat request, one with `prompt` a completion, each answered as its own endpoint answers it; anything
else is a 400 with the OpenAI error object. It was a 404."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from factories import tiny_engine_url, tiny_spec

from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def url(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[str]:
    with tiny_engine_url(make_model(tiny_spec()), max_model_len=256) as base:
        yield base


def _post(url: str, path: str, body: object) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=60)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 6}),
])
def test_an_invocation_is_answered_as_its_endpoint_answers(url: str, path: str, body: dict[str, object]) -> None:
    body = {**body, "model": "tiny", "temperature": 0, "ignore_eos": True}
    got, want = _post(url, "/invocations", body), _post(url, path, body)
    assert got.status_code == want.status_code == 200, got.text
    g, w = got.json(), want.json()
    assert g["object"] == w["object"] and g["usage"] == w["usage"]
    field = "message" if "messages" in body else "text"
    assert g["choices"][0][field] == w["choices"][0][field]


def test_an_invocation_streams_when_asked(url: str) -> None:
    """Streamed as /v1/completions streams: SSE chunks (a chunk may carry several tokens when the
    reader is behind) whose text is the whole answer's, then [DONE]."""
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{url}/invocations", json={**body, "stream": True}, timeout=60, stream=True)
    lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(ln.removeprefix(b"data: ")) for ln in lines[:-1]]
    whole = _post(url, "/v1/completions", body).json()["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "tiny"}, None),  # neither messages nor prompt
    ([1, 2], None),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": "tiny", "messages": "not a list"}, "messages"),
])
def test_a_bad_invocation_is_a_400_with_the_error_object(url: str, body: object, param: str | None) -> None:
    r = _post(url, "/invocations", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == param
    bad_json = requests.post(f"{url}/invocations", data=b"{nope", headers={"content-type": "application/json"},
                             timeout=60)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "BadRequestError"
    assert _post(url, "/invocations", {"model": "tiny", "prompt": "ok", "max_tokens": 1}).status_code == 200
