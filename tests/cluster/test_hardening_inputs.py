"""Hostile clients at the gateway (issue 16): every request over a bound, of a
wrong type, malformed, or asking for what pdserve does not do is refused with
OpenAI's error object naming the field, counted in
`pdserve:requests_refused_total{reason}`, and harms nothing: a normal request
still works after it. Over a fake backend (no engine): what is tested is the
gateway."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, tiny_spec
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.openai_app import build_app
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"
KEY = {"Authorization": "Bearer sekret"}
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class EchoBackend(FakeBackend):
    """Three tokens at once; records what it was asked to run."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.calls.append((prompt, params))
        n = params.max_tokens or 1
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x" * n, [7] * n, finish_reason="length")],
                           finished=True)


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec()))


def gateway(tokenizer: Any, backend: Any = None, **config: Any) -> Gateway:
    return Gateway(backend or EchoBackend(), tokenizer,
                   GatewayConfig(**{"model_name": MODEL, "max_model_len": 256, "api_key": "sekret", **config}))


def refused(gw: Gateway) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in gw.metrics.refused.collect()[0].samples if s.name.endswith("_total")}


def run(gw: Gateway, requests: Callable[[httpx.AsyncClient], Any]) -> Any:
    async def main() -> Any:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=30) as c:
            return await requests(c)

    return asyncio.run(main())


def assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert err["param"] == param, err
    assert r.headers["x-request-id"]


LIMITS = RequestLimits(max_n=8, max_stop=4, max_stop_length=16, max_messages=4, max_logit_bias=4, max_prompts=4)

# (endpoint, body, param, reason)
HOSTILE = [
    ("/v1/completions", {**OK, "n": 10**6}, "n", "limit"),
    ("/v1/completions", {**OK, "n": 9}, "n", "limit"),
    # Below 1: refused before admission, where a negative share would let others past the bound.
    ("/v1/completions", {**OK, "n": 0}, "n", "malformed"),
    ("/v1/chat/completions", {**CHAT, "n": -10**6, "messages": [{"role": "user", "content": "x" * 600}]}, "n",
     "malformed"),
    ("/v1/completions", {**OK, "best_of": 3}, "best_of", "unsupported"),
    ("/v1/completions", {**OK, "n": 2, "best_of": 1}, "best_of", "unsupported"),
    ("/v1/completions", {**OK, "stop": ["s"] * 10**5}, "stop", "limit"),
    ("/v1/completions", {**OK, "stop": "x" * 17}, "stop", "limit"),
    ("/v1/completions", {**OK, "stop_token_ids": [1] * 5}, "stop_token_ids", "limit"),
    ("/v1/completions", {**OK, "logit_bias": {str(i): 1 for i in range(5)}}, "logit_bias", "limit"),
    ("/v1/completions", {**OK, "prompt": ["a"] * 5}, "prompt", "limit"),
    ("/v1/completions", {**OK, "cache_salt": "s" * 257}, "cache_salt", "limit"),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 5}, "messages", "limit"),
    ("/v1/chat/completions", {**CHAT, "n": 10**6}, "n", "limit"),
    # Asked for, and not done: refused by name, not answered with free text.
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format", "malformed"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema", "malformed"),
    ("/v1/completions", {**OK, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "malformed"),
    ("/v1/completions", {**OK, "structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
     "structured_outputs", "malformed"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools",
     "malformed"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice", "malformed"),  # no tools
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}}, "guided_json", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages", "unsupported"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages", "malformed"),  # the client's mistake: it was "unsupported", its message "got type 'text'"
    ("/v1/completions", {**OK, "suffix": "}"}, "suffix", "unsupported"),
    ("/v1/completions", {**OK, "use_beam_search": True}, "use_beam_search", "unsupported"),
    # Token ids outside the vocabulary (4096): refused at the gateway, never on a worker.
    ("/v1/completions", {**OK, "logit_bias": {"99999": 5}}, "logit_bias", "malformed"),
    ("/v1/completions", {**OK, "prompt": [1, 2, 99999]}, "prompt", "malformed"),
    ("/v1/completions", {**OK, "prompt": [1, 2**63]}, "prompt", "malformed"),
    ("/v1/completions", {**OK, "stop_token_ids": [5000]}, "stop_token_ids", "malformed"),
]


@pytest.mark.parametrize(("path", "body", "param", "reason"), HOSTILE, ids=[h[2] for h in HOSTILE])
def test_hostile_requests_are_refused_by_name_and_counted(tokenizer: Any, path: str, body: dict, param: str,
                                                          reason: str) -> None:
    backend = EchoBackend()
    gw = gateway(tokenizer, backend, limits=LIMITS)

    async def requests(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        return await c.post(path, json=body, headers=KEY), await c.post(path, json=CHAT if "chat" in path else OK,
                                                                        headers=KEY)

    bad, after = run(gw, requests)
    assert_openai_error(bad, 400, param)
    assert refused(gw)[reason] == 1 and sum(refused(gw).values()) == 1
    assert len(backend.calls) == 1 and after.status_code == 200  # only the normal request ran
    assert gw.admitted == 0


def test_what_clients_send_by_default_still_works(tokenizer: Any) -> None:
    """Off values of the refused options, and what OpenAI clients send that asks
    nothing of the model, pass."""
    backend = EchoBackend()
    gw = gateway(tokenizer, backend)
    bodies = [
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
                                  "user": "u-1", "metadata": {"a": "b"}, "store": False, "seed": 3,
                                  "parallel_tool_calls": False, "stream_options": None}),
        ("/v1/completions", {**OK, "best_of": 1, "logprobs": None, "ignore_eos": True, "repetition_penalty": 1.0,
                             "user": "u-1", "cache_salt": "tenant-a"}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ]

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post(path, json=body, headers=KEY) for path, body in bodies]

    assert [r.status_code for r in run(gw, requests)] == [200, 200, 200]
    assert backend.calls[1][1].cache_salt == "tenant-a"


def _wrong_type(schema: dict[str, Any]) -> Any:
    """A JSON value none of the field's schema types accepts."""
    def kinds(s: dict[str, Any]) -> set[str]:
        if "$ref" in s:
            return {"object"}
        if "anyOf" in s:
            return set().union(*(kinds(x) for x in s["anyOf"]))
        if "enum" in s or "const" in s:
            return {"enum"}
        return {s.get("type", "any")}

    accepted = kinds(schema)
    for value, kind in ((["x"], "array"), ({"x": 1}, "object"), ("x", "string"), (1.5, "number")):
        if kind not in accepted and not (kind == "number" and "integer" in accepted):
            return value
    raise AssertionError(f"no wrong type for {schema}")


def _fields(spec: dict[str, Any], model: str) -> dict[str, dict[str, Any]]:
    return dict(spec["components"]["schemas"][model]["properties"])


def test_a_wrong_type_in_every_field_is_a_400_naming_it(tokenizer: Any) -> None:
    gw = gateway(tokenizer)

    async def requests(c: httpx.AsyncClient) -> list[tuple[str, Any, httpx.Response]]:
        spec = (await c.get("/openapi.json", headers=KEY)).json()
        out = []
        for model, path, base in (("CompletionRequest", "/v1/completions", OK),
                                  ("ChatCompletionRequest", "/v1/chat/completions", CHAT)):
            for name, schema in _fields(spec, model).items():
                value = _wrong_type(schema)
                out.append((name, value, await c.post(path, json={**base, name: value}, headers=KEY)))
        out.append(("ok", None, await c.post("/v1/completions", json=OK, headers=KEY)))
        return out

    results = run(gw, requests)
    assert len(results) > 40  # every field of both requests
    *bad, (_, _, ok) = results
    for name, value, r in bad:
        assert r.status_code == 400, (name, value, r.text)
        assert r.json()["error"]["param"] == name, (name, value, r.json())
    assert ok.status_code == 200
    assert refused(gw)["malformed"] == len(bad)


@pytest.mark.parametrize(("content", "headers"), [
    (b'{"model": "tiny", "prompt": ', {"content-type": "application/json"}),  # truncated JSON
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', {"content-type": "application/json"}),  # not UTF-8
    (b"\x00\x01\x02", {"content-type": "application/json"}),
    (b'["a", "list"]', {"content-type": "application/json"}),
    (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e999}', {"content-type": "application/json"}),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', {"content-type": "application/json"}),
    (b'{"model": "tiny", "prompt": "\\ud800"}', {"content-type": "application/json"}),  # JSON, but no Unicode
])
def test_malformed_bodies_are_400s_with_the_error_object(tokenizer: Any, content: bytes,
                                                         headers: dict[str, str]) -> None:
    gw = gateway(tokenizer)

    async def requests(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        return (await c.post("/v1/completions", content=content, headers={**KEY, **headers}),
                await c.post("/v1/completions", json=OK, headers=KEY))

    bad, ok = run(gw, requests)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    assert refused(gw)["malformed"] == 1 and ok.status_code == 200


def test_huge_body_is_413_before_it_is_read(tokenizer: Any) -> None:
    gw = gateway(tokenizer, limits=RequestLimits(max_body_bytes=1 << 16))
    body = json.dumps({**OK, "prompt": "word " * 20_000}).encode()
    assert len(body) > 1 << 16

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/v1/completions", content=body, headers=KEY),
                await c.post("/v1/completions", content=chunks(), headers=KEY),
                await c.post("/v1/completions", json=OK, headers=KEY)]

    declared, streamed, ok = run(gw, requests)
    assert_openai_error(declared, 413, None)
    assert_openai_error(streamed, 413, None)
    assert ok.status_code == 200 and refused(gw)["body_too_large"] == 2
    scraped = run(gw, lambda c: c.get("/metrics", headers=KEY)).text
    errors = {s.labels["code"]: s.value for f in text_string_to_metric_families(scraped)
              if f.name == "pdserve:request_errors" for s in f.samples}
    assert errors["413"] == 2


def test_admission_is_taken_at_once(tokenizer: Any) -> None:
    """Many requests at the same moment: exactly max_in_flight run, the others get
    429 with Retry-After (the check and the count had awaits between them: all ran)."""

    class Held(FakeBackend):
        def __init__(self) -> None:
            self.running = 0
            self.go = asyncio.Event()

        async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                           timeout_s: float) -> AsyncIterator[RequestOutput]:
            self.running += 1
            await asyncio.wait_for(self.go.wait(), 10)
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7], finish_reason="length")],
                                finished=True)

    backend = Held()
    gw = gateway(tokenizer, backend, max_in_flight=3)

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        tasks = [asyncio.create_task(c.post("/v1/completions", json={**OK, "stream": i % 2 == 0}, headers=KEY))
                 for i in range(20)]
        deadline = asyncio.get_running_loop().time() + 10
        # The 17 refusals come back at once; the 3 admitted reach the backend once
        # their prompts are tokenized (on the tokenizer thread): wait for both.
        while ((sum(t.done() for t in tasks) < 17 or backend.running < 3)
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # a fourth, wrongly admitted, would have got there too
        assert backend.running == 3
        assert sum(t.done() for t in tasks) == 17
        backend.go.set()
        return await asyncio.gather(*tasks)

    responses = run(gw, requests)
    assert sorted(r.status_code for r in responses) == [200] * 3 + [429] * 17
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    assert refused(gw)["capacity"] == 17 and gw.admitted == 0


def test_tokenizing_does_not_stall_the_event_loop(tokenizer: Any) -> None:
    """A prompt that takes long to tokenize: /health answers meanwhile."""
    import time

    class SlowTokenizer:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def encode(self, text: str, **kw: Any) -> list[int]:
            time.sleep(1.0)  # what a multi-megabyte prompt costs
            return list(self.inner.encode(text, **kw))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    gw = gateway(SlowTokenizer(tokenizer))

    async def requests(c: httpx.AsyncClient) -> tuple[float, httpx.Response]:
        slow = asyncio.create_task(c.post("/v1/completions", json=OK, headers=KEY))
        await asyncio.sleep(0.1)
        start = time.perf_counter()
        assert (await c.get("/health")).status_code == 200
        return time.perf_counter() - start, await slow

    health_s, slow = run(gw, requests)
    assert health_s < 0.5 and slow.status_code == 200


def test_n_below_one_is_refused_before_the_request_takes_a_share_of_the_bound(tokenizer: Any) -> None:
    """A request's share of the admission bound is its prompts x n. With n below 1 the share
    would be negative: while its long prompt was tokenized, the count others are admitted
    under would sit far below the bound, and any number of them would pass."""
    gw = gateway(tokenizer, EchoBackend(), limits=LIMITS)
    shares: list[int] = []
    admit = gw.admit

    def counting(num_requests: int = 1) -> Any:
        shares.append(num_requests)
        return admit(num_requests)

    gw.admit = counting  # type: ignore[method-assign]
    body = {**CHAT, "n": -10**6, "messages": [{"role": "user", "content": "x" * 600}]}

    async def request(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post("/v1/chat/completions", json=body, headers=KEY)

    assert_openai_error(run(gw, request), 400, "n")
    assert shares == [] and gw.admitted == 0
    with pytest.raises(ValueError, match="num_requests"):
        admit(-1)


def test_messages_the_models_chat_template_refuses_are_a_400(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Many models' templates refuse what they cannot render (`raise_exception`: roles that
    do not alternate, a system role the model has none of). That is the client's to fix:
    a 400 naming `messages`, as vLLM answers, not a 500. The same conversation without the
    system message is served."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_model(tiny_spec()))
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                         "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    gw = gateway(tok)
    system = {**CHAT, "messages": [{"role": "system", "content": "be brief"}, *CHAT["messages"]]}

    async def requests(c: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
        return (await c.post("/v1/chat/completions", json=system, headers=KEY),
                await c.post("/v1/chat/completions", json=CHAT, headers=KEY))

    bad, good = run(gw, requests)
    assert_openai_error(bad, 400, "messages")
    assert "System role not supported" in bad.json()["error"]["message"]
    assert good.status_code == 200 and gw.admitted == 0


THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_vllm_passes_them(tokenizer: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `chat_template_kwargs` (Qwen3's `{"enable_thinking": false}`, what agent clients
    send on every request to such a model) was a 400 "pdserve does not support this field".
    They are now the template's variables, as transformers renders them (the oracle); the
    renderer's own arguments are refused by name, as vLLM refuses `tokenize` there."""
    monkeypatch.setattr(tokenizer, "chat_template", THINKING)
    backend = EchoBackend()
    gw = gateway(tokenizer, backend)
    off = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    refusals = [{**CHAT, "chat_template_kwargs": {"tokenize": True}},
                {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False}},
                {**CHAT, "chat_template_kwargs": ["enable_thinking"]}]

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/v1/chat/completions", json=b, headers=KEY) for b in (off, CHAT, *refusals)]

    answers = run(gw, requests)
    assert [r.status_code for r in answers[:2]] == [200, 200], answers[0].text
    want = [tokenizer.apply_chat_template(CHAT["messages"], tokenize=False, add_generation_prompt=True, **kw)
            for kw in ({"enable_thinking": False}, {})]
    assert "<no-think>" in want[0] and "<no-think>" not in want[1]
    assert [prompt for prompt, _ in backend.calls] == [tokenizer.encode(w, add_special_tokens=False) for w in want]
    for r in answers[2:]:
        assert_openai_error(r, 400, "chat_template_kwargs")
    assert "'tokenize'" in answers[2].json()["error"]["message"]
    assert len(backend.calls) == 2


def test_the_servers_default_chat_template_kwargs_reach_every_chat_under_the_requests(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's --default-chat-template-kwargs: every chat's template variables start from them;
    a request's own chat_template_kwargs win, key by key."""
    monkeypatch.setattr(tokenizer, "chat_template", THINKING)
    backend = EchoBackend()
    gw = gateway(tokenizer, backend, default_template_kwargs={"enable_thinking": False})
    on = {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/v1/chat/completions", json=b, headers=KEY) for b in (CHAT, on)]

    assert [r.status_code for r in run(gw, requests)] == [200, 200]
    want = [tokenizer.apply_chat_template(CHAT["messages"], tokenize=False, add_generation_prompt=True,
                                          enable_thinking=e) for e in (False, True)]
    assert [prompt for prompt, _ in backend.calls] == [tokenizer.encode(w, add_special_tokens=False) for w in want]
    assert "<no-think>" in want[0] and "<no-think>" not in want[1]


EFFORT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
          "<effort={{ reasoning_effort | default('unset') }}>")


def test_reasoning_effort_reaches_the_template_and_chat_template_kwargs_win(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI's reasoning_effort (agent clients send it) was a 400 "pdserve does not support this
    field": it is the template's variable of that name (gpt-oss's template reads it), under a
    chat_template_kwargs' own; a value OpenAI does not have is a 400 naming it."""
    monkeypatch.setattr(tokenizer, "chat_template", EFFORT)
    backend = EchoBackend()
    gw = gateway(tokenizer, backend, default_template_kwargs={"reasoning_effort": "low"})
    bodies = [CHAT, {**CHAT, "reasoning_effort": "high"},
              {**CHAT, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "minimal"}},
              {**CHAT, "reasoning_effort": "extreme"}]

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/v1/chat/completions", json=b, headers=KEY) for b in bodies]

    answers = run(gw, requests)
    assert [r.status_code for r in answers[:3]] == [200, 200, 200], answers[1].text
    want = [tokenizer.apply_chat_template(CHAT["messages"], tokenize=False, reasoning_effort=e)
            for e in ("low", "high", "minimal")]
    assert [prompt for prompt, _ in backend.calls] == [tokenizer.encode(w, add_special_tokens=False) for w in want]
    assert_openai_error(answers[3], 400, "reasoning_effort")


def test_tokenize_takes_chat_template_kwargs(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """/tokenize counts a chat as the chat route renders it, chat_template_kwargs included
    (vLLM's /tokenize takes them too)."""
    monkeypatch.setattr(tokenizer, "chat_template", THINKING)
    messages = CHAT["messages"]
    kwargs = {"enable_thinking": False}

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": kwargs}, headers=KEY),
                await c.post("/tokenize", json={"prompt": "hi", "chat_template_kwargs": kwargs}, headers=KEY),
                await c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"chat_template": "x"}},
                             headers=KEY)]

    counted, prompt_with_kwargs, refused_kwarg = run(gateway(tokenizer), requests)
    want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert counted.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    assert_openai_error(prompt_with_kwargs, 400, "chat_template_kwargs")
    assert_openai_error(refused_kwarg, 400, "chat_template_kwargs")


def test_browsers_on_allowed_origins_may_call_the_api_and_no_others(tokenizer: Any) -> None:
    """vLLM answers browsers' cross-origin requests (CORS, --allowed-origins); pdserve answered
    none, so a web UI on another origin could not call it (its preflight got the guard's 401).
    Now the origins named are allowed: the preflight (which carries no key) is answered, and a
    response, a refusal included, carries the header the page needs to read it. Other origins,
    and every origin by default, get no such header (the browser stops them)."""
    from pdserve.cluster.cors import CorsSettings

    ui = "http://localhost:3000"
    preflight = {"Origin": ui, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def requests(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.options("/v1/chat/completions", headers=preflight),
                await c.post("/v1/chat/completions", json=CHAT, headers={**KEY, "Origin": ui}),
                await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ui}),
                await c.post("/v1/chat/completions", json=CHAT, headers={**KEY, "Origin": "https://evil.example"})]

    allowed = run(gateway(tokenizer, cors=CorsSettings(allowed_origins=(ui,))), requests)
    assert allowed[0].status_code == 200 and allowed[0].headers["access-control-allow-origin"] == ui
    assert "POST" in allowed[0].headers["access-control-allow-methods"]
    assert [r.status_code for r in allowed[1:]] == [200, 401, 200]
    assert [r.headers.get("access-control-allow-origin") for r in allowed[1:]] == [ui, ui, None]
    default = run(gateway(tokenizer), requests)
    assert all("access-control-allow-origin" not in r.headers for r in default)
    assert default[0].status_code != 200


@pytest.mark.parametrize(("settings", "error"), [
    ({"allowed_origins": "*", "allow_credentials": True}, "^allow_credentials: name the allowed origins"),
    ({"allowed_origins": '["https://a.example"'}, "^allowed_origins: not a JSON list"),
    ({"allowed_origins": '["https://a.example", 3]'}, "^allowed_origins: a list of non-empty strings"),
])
def test_cors_settings_are_checked_where_they_are_made(settings: dict[str, Any], error: str) -> None:
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.config import EngineConfig

    with pytest.raises(ValueError, match=error):
        ServeConfig(EngineConfig(model="/m"), **settings)
    one = ServeConfig(EngineConfig(model="/m"), allowed_origins='["https://a.example", "https://b.example"]')
    assert one.cors.allowed_origins == ("https://a.example", "https://b.example")
    assert ServeConfig(EngineConfig(model="/m"), allowed_origins="*").cors.allowed_origins == ("*",)


@pytest.mark.parametrize(("value", "error"), [
    ('{"enable_thinking": false', "not a JSON object"), ('["enable_thinking"]', "a JSON object"),
    ({"tokenize": True}, "'tokenize' cannot be set here"),
])
def test_default_chat_template_kwargs_are_checked_where_they_are_made(value: Any, error: str) -> None:
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.config import EngineConfig

    with pytest.raises(ValueError, match=f"^default_chat_template_kwargs: .*{error}"):
        ServeConfig(EngineConfig(model="/m"), default_chat_template_kwargs=value)
    made = ServeConfig(EngineConfig(model="/m"), default_chat_template_kwargs='{"enable_thinking": false}')
    assert made.default_chat_template_kwargs == {"enable_thinking": False}
