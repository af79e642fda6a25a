"""Hostile inputs that used to end in a 500 or in minutes of compiling: deep nesting (tools,
tool-call arguments, a model told to write brackets), lone surrogates echoed in an error, a
client-set `origin`, a 200,000-character field name, schemas cheap to send and dear to
compile. Each is a 400 naming its field (or, for the model's own output, text as content),
and the server serves the next request. A real tiny engine behind the in-process app."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from starlette.testclient import TestClient

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.structured_outputs import MAX_SCHEMA_DEPTH, MAX_SCHEMA_PROPERTIES
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def served(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[tuple[LLM, Gateway, TestClient]]:
    llm = LLM(str(make_model(tiny_spec())), max_model_len=2048, num_kv_blocks=256, progress=False)
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name="tiny", max_model_len=2048, max_in_flight=16, request_timeout_s=30))
    try:
        with TestClient(build_app(gw), raise_server_exceptions=False) as client:
            yield llm, gw, client
    finally:
        engine.close()


def post(client: TestClient, path: str, body: bytes | dict[str, Any]) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def nested(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


USER = '[{"role":"user","content":"hi"}]'
TOOL = '[{"type":"function","function":{"name":"f","parameters":' + nested(300) + "}}]"
CASES: dict[str, tuple[str, bytes, str]] = {
    "surrogate-model": ("/v1/completions", b'{"model":"\\ud800","prompt":"hi","max_tokens":2}', "model"),
    "surrogate-model-detokenize": ("/detokenize", b'{"model":"\\ud800","tokens":[1]}', "model"),
    "surrogate-bad-words": ("/v1/completions", b'{"prompt":"hi","max_tokens":2,"bad_words":["\\ud800"]}',
                            "bad_words"),  # it failed in the engine: a 500 (its tokenizer takes no surrogate)
    "empty-tool-choice": ("/v1/chat/completions", ('{"messages":' + USER + ',"max_tokens":2,"tool_choice":{},'
                                                  '"tools":[{"type":"function","function":{"name":"f"}}]}').encode(),
                          "tool_choice"),  # it was taken as "none"
    "client-origin": ("/v1/completions",
                      b'{"prompt":"hi","max_tokens":2,"structured_outputs":{"regex":"(","origin":"\\ud800"}}',
                      "structured_outputs"),
    "deep-tool-parameters": ("/v1/chat/completions",
                             ('{"messages":' + USER + ',"max_tokens":2,"tools":' + TOOL + "}").encode(), "tools"),
    "deep-tool-parameters-tokenize": ("/tokenize", ('{"messages":' + USER + ',"tools":' + TOOL + "}").encode(),
                                      "tools"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_nested_or_unencodable_input_is_a_400_naming_its_field(served: tuple[LLM, Gateway, TestClient],
                                                                   name: str) -> None:
    _, gw, client = served
    path, raw, field = CASES[name]
    r = post(client, path, raw)
    assert r.status_code in (400, 404), r.text[:300]
    assert (r.json()["error"]["param"] or "").startswith(field), r.json()
    assert post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert gw.admitted == 0


def test_tool_call_arguments_too_deep_to_parse_are_taken_as_not_json(served: tuple[LLM, Gateway, TestClient]) -> None:
    """An earlier turn's call whose arguments are 5,000 '[': not JSON an object can be read
    from (the parser's stack ends first), passed on as other bad arguments are: served."""
    _, _, client = served
    raw = ('{"messages":[{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":"'
           + "[" * 5000 + '"}}]},{"role":"user","content":"x"}],"max_tokens":2}').encode()
    assert post(client, "/v1/chat/completions", raw).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_model_made_to_write_deep_brackets_answers_in_text(served: tuple[LLM, Gateway, TestClient],
                                                              stream: bool) -> None:
    """With tools, the answer is parsed for calls: 1,100 '[' (a logit bias makes the model
    write them) overflowed the JSON parser's stack, a 500 after the whole generation."""
    llm, _, client = served
    bracket = llm.tokenizer.convert_tokens_to_ids("[")
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 1100, "ignore_eos": True,
            "logit_bias": {str(bracket): 100}, "stream": stream, "tools": [{"type": "function",
                                                                            "function": {"name": "f"}}]}
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    if stream:
        assert '"error"' not in r.text and r.text.rstrip().endswith("data: [DONE]")
    else:
        message = r.json()["choices"][0]["message"]
        assert message.get("tool_calls") is None and message["content"].count("[") >= 1000


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("arguments", "parsed"), [
    ('{"a": "\\ud800"}', {"a": "\ud800"}),  # JSON may escape a lone surrogate; UTF-8 cannot carry it
    ('{"a": NaN}', None),  # Python's parser takes NaN, JSON has none: not a call
], ids=["surrogate", "nan"])
def test_a_tool_call_the_model_writes_is_served_as_json_or_as_content(served: tuple[LLM, Gateway, TestClient],
                                                                      stream: bool, arguments: str,
                                                                      parsed: dict[str, Any] | None) -> None:
    """The model's own output (a regex makes it write this call) never fails its response: a
    whole answer whose call carried "\\ud800" was a 500 (Starlette's JSON refused it), and
    arguments with NaN went out as JSON text that was not JSON."""
    _, _, client = served
    call = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 60, "stream": stream,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "structured_outputs": {"regex": re.escape(call)}}
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text[:300]
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]") and not any("error" in e for e in events)
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        calls = [c for d in deltas for c in d.get("tool_calls") or []]
        content = "".join(d.get("content") or "" for d in deltas)
        args = "".join(c["function"].get("arguments") or "" for c in calls)
    else:
        message = r.json()["choices"][0]["message"]
        calls, content = message.get("tool_calls") or [], message.get("content") or ""
        args = "".join(c["function"]["arguments"] for c in calls)
    if parsed is None:
        assert not calls and content == call
    else:
        assert len(calls) == 1 and json.loads(args) == parsed


def test_a_long_field_name_is_not_echoed_whole(served: tuple[LLM, Gateway, TestClient]) -> None:
    _, _, client = served
    r = post(client, "/v1/completions", {"prompt": "hi", "z" * 200_000: 1})
    assert r.status_code == 400 and len(r.content) < 2_000
    assert r.json()["error"]["param"] == "z" * 64 + "..."


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "object", "properties": {f"a{i}": {"type": "string"} for i in range(2000)}}, "properties"),
    (json.loads(nested(MAX_SCHEMA_DEPTH)), "deep"),
])
def test_a_schema_too_dear_to_compile_is_refused_before_compiling(served: tuple[LLM, Gateway, TestClient],
                                                                 schema: dict[str, Any], why: str) -> None:
    """2,000 optional properties took xgrammar ~30 s to compile, a thread no 400 could free,
    while 57 KB is well under the 256 KiB a schema's text may be: refused by its size in
    properties (more than 1,024 in all) or depth (more than 32) before any compile."""
    _, _, client = served
    start = time.monotonic()
    r = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and time.monotonic() - start < 2.0
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert str(MAX_SCHEMA_PROPERTIES if why == "properties" else MAX_SCHEMA_DEPTH) in error["message"]
