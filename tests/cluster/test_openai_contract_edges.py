"""The OpenAI contract of /v1/completions and /v1/chat/completions past the happy path: what
OpenAI's reference and vLLM do, each case a fault found by a review (each test failed before)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from factories import serve_gateway, sse_events, tiny_spec

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway
from pdserve.cluster.serve_app import gateway_config
from pdserve.cluster.serve_config import ServeConfig
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.tiny.builder import TinyModelSpec

LEN = 64


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    engine = AsyncEngine(LLM(str(model_dir), max_model_len=LEN, num_kv_blocks=128, progress=False).engine).start()
    try:
        cfg = ServeConfig(EngineConfig(str(model_dir)), served_model_name=("tiny",))
        gw = Gateway(LocalBackend(engine), engine.engine.tokenizer, gateway_config(cfg, LEN, str(model_dir)))
        with serve_gateway(gw) as base:
            yield base
    finally:
        engine.close()


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/v1", timeout=60)


def test_streamed_text_offset_matches_the_whole_response(url: str) -> None:
    """text_offset is each token's first character in the choice's text (OpenAI's legacy
    logprobs; docs/api.md: "... (streamed too)"). A stop string makes the engine hold text back
    while the tokens go ahead; the streamed offsets then lag the text. The same greedy request,
    streamed, must report the offsets the whole response reports."""
    body = {"prompt": "hello world", "max_tokens": 8, "logprobs": 0, "temperature": 0, "stop": ["zzzzzz"]}
    with _client(url) as c:
        whole = c.post("/completions", json=body).json()["choices"][0]["logprobs"]
        events = sse_events(c.post("/completions", json={**body, "stream": True}).text)
    tokens, offsets = [], []
    for e in events:
        for ch in e["choices"]:
            if ch["logprobs"]:
                tokens += ch["logprobs"]["tokens"]
                offsets += ch["logprobs"]["text_offset"]
    assert tokens == whole["tokens"]
    assert offsets == whole["text_offset"]


@pytest.mark.parametrize("path,body", [
    ("/completions", {"prompt": "hello", "max_tokens": 2, "stream": None}),
    ("/completions", {"prompt": "hello", "max_tokens": 2, "echo": None}),
    ("/completions", {"prompt": "hello", "max_tokens": 2, "suffix": None}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": None}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": None}),
])
def test_openai_nullable_fields_take_null_as_unset(url: str, path: str, body: dict[str, object]) -> None:
    """OpenAI's reference types these fields "... or null" (stream, echo, suffix, n, logprobs),
    and vLLM's request models take null for each (`stream: bool | None = False`, chat's
    `n: int | None = 1`, `logprobs: bool | None = False`, completions' `echo: bool | None`,
    `suffix: str | None`): null is the default, not a 400."""
    with _client(url) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_max_tokens_null_is_the_rest_of_the_context(url: str, path: str) -> None:
    """vLLM takes an explicit `max_tokens: null` as no bound but the context, on both routes
    (completions' default, when it is left out, is 16): a prompt LEN - 5 tokens long gets 5.
    Completions took null as 16, a 400 for going past the context."""
    with _client(url) as c:
        if path == "/completions":
            body: dict[str, object] = {"prompt": [5] * (LEN - 5)}
        else:
            n = c.post(url.removesuffix("/v1") + "/tokenize",
                       json={"messages": [{"role": "user", "content": "a"}]}).json()["count"]
            body = {"messages": [{"role": "user", "content": "a " * (LEN - 5 - n + 1)}]}
        r = c.post(path, json={**body, "max_tokens": None, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == LEN, usage
        assert r.json()["choices"][0]["finish_reason"] == "length"
        left_out = c.post("/completions", json={"prompt": [5] * 8, "ignore_eos": True, "temperature": 0}).json()
        assert left_out["usage"]["completion_tokens"] == 16


def test_text_content_parts_are_joined_by_newlines(url: str) -> None:
    """vLLM renders a message whose content is a list of text parts as the parts joined by
    "\\n" (entrypoints/chat_utils.py `_parse_chat_message_content_parts`: "\\n".join(texts)); pdserve
    joins them with nothing, so ["Hello", "world"] reaches the model as "Helloworld"."""
    parts = {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
    joined = {"role": "user", "content": "Hello\nworld"}
    with _client(url) as c:
        a = c.post("/chat/completions", json={"messages": [parts], "max_tokens": 1, "temperature": 0}).json()
        b = c.post("/chat/completions", json={"messages": [joined], "max_tokens": 1, "temperature": 0}).json()
    with httpx.Client(base_url=url, timeout=60) as c:
        ta = c.post("/tokenize", json={"messages": [parts]}).json()["tokens"]
        tb = c.post("/tokenize", json={"messages": [joined]}).json()["tokens"]
    assert ta == tb
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_malformed_json_names_no_field(url: str) -> None:
    """A body that is not JSON: 400 whose `param` is null (no field is at fault; vLLM's is null)
    and whose message says the JSON is malformed. pdserve takes the parser's character position
    from the error's loc as the field: param "1", message "1: JSON decode error"."""
    with _client(url) as c:
        r = c.post("/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] is None, err
    assert not err["message"].startswith("1:"), err


def test_safety_identifier_and_prompt_cache_key_accepted_as_user_is(url: str) -> None:
    """OpenAI deprecated `user` for `safety_identifier` and `prompt_cache_key` (the openai client
    sends them as parameters of chat.completions.create). They ask nothing of the model, as `user`
    (which pdserve accepts and ignores); vLLM ignores unknown fields. A client that moved off `user`
    as OpenAI asks gets a 400 here."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       safety_identifier="user-123", prompt_cache_key="tenant-a")
    assert r.choices[0].finish_reason == "length"


def test_wrong_content_type_is_named(url: str) -> None:
    """A JSON object sent without `Content-Type: application/json` (requests' `data=`, curl's
    -d default): the 400 must say what is wrong. FastAPI 0.165's strict content type leaves
    the body unparsed and the message says the body is not an object, which it is."""
    body = json.dumps({"prompt": "hello", "max_tokens": 2})
    with _client(url) as c:
        r = c.post("/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert "content-type" in r.json()["error"]["message"].lower(), r.text


def test_neighbouring_seeds_with_n_share_no_samples(url: str) -> None:
    """A seed makes a request reproducible; two different seeds are two independent draws.
    pdserve seeds sample j of a request with `seed + j` (gateway.Gateway.run), so a request
    with seed 7 and n=2 and one with seed 8 and n=2 return the same text as choice 1 and
    choice 0: a harness that runs seeds 0, 1, 2... with n=4 gets 3 of every 4 samples again.
    vLLM seeds one generator per request from `seed`, whatever n."""
    body = {"prompt": "hello world", "max_tokens": 12, "n": 2, "temperature": 1.0}
    with _client(url) as c:
        a = [ch["text"] for ch in c.post("/completions", json={**body, "seed": 7}).json()["choices"]]
        b = [ch["text"] for ch in c.post("/completions", json={**body, "seed": 8}).json()["choices"]]
    assert a[0] != a[1]
    assert a[1] != b[0], (a, b)


@pytest.mark.parametrize("value", [True, False])
def test_vllms_spaces_between_special_tokens_is_accepted(url: str, value: bool) -> None:
    """vLLM's field shapes the text of slow tokenizers only; with a fast one (pdserve's only kind)
    vLLM ignores it. A vLLM client sending it got a 400 here."""
    with _client(url) as c:
        r = c.post("/completions", json={"prompt": "hi", "max_tokens": 2, "spaces_between_special_tokens": value})
    assert r.status_code == 200, r.text


def test_safety_identifier_alone_accepted(url: str) -> None:
    with _client(url) as c:
        r = c.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "safety_identifier": "user-123"})
    assert r.status_code == 200, r.text


def test_a_stream_says_it_is_not_to_be_cached(url: str) -> None:
    """OpenAI's streams carry `Cache-Control: no-cache`: a cache or proxy in front must neither
    keep an event stream nor hold it back."""
    with _client(url) as c:
        r = c.post("/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
