"""The OpenAI API over real HTTP (uvicorn on loopback) with the official client,
over one in-process engine. The cluster backends plug into the same gateway."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from factories import FakeBackend, serve_gateway, slow_steps, tiny_engine_url, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[str, AsyncEngine]]:
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer,
                 GatewayConfig(model_name=MODEL, max_model_len=256, api_key="sekret",
                                                      max_in_flight=64))
    with serve_gateway(gw, log_level="warning") as url:
        yield url, engine
    engine.close()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0, timeout=30)


def test_completion_greedy_equals_offline_engine(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    prompt = "def fibonacci(n):"
    resp = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert resp.choices[0].text == expected.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids) and resp.usage.completion_tokens == 20


def test_streaming_completion_concatenates_to_the_same_text(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    stream = client(url).completions.create(model=MODEL, prompt="import os\n", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = offline.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert text == expected.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    # stop_reason on the last chunk of the choice only (null: it ran to its length), as vLLM's
    said = [getattr(c.choices[0], "stop_reason", "absent") for c in chunks if c.choices]
    assert said[-1] is None and set(said[:-1]) <= {"absent"}, said


def test_force_include_usage_ends_every_stream_with_its_usage(model_dir: Path, offline: LLM) -> None:
    """vLLM's --enable-force-include-usage: a stream that asked for no usage still ends with it (the
    chunk of no choices a client that asks gets), for completions and chat."""
    with tiny_engine_url(model_dir, max_model_len=256, force_include_usage=True) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        text = list(c.completions.create(model="tiny", prompt="import os\n", max_tokens=7, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}))
        chat = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    want = offline.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    last = text[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(want.prompt_token_ids), 7)
    assert chat[-1].choices == [] and chat[-1].usage is not None and chat[-1].usage.completion_tokens == 5
    assert all(chunk.usage is None for chunk in text[:-1] + chat[:-1])


def test_continuous_usage_counts_every_chunk_so_far(server: tuple[str, AsyncEngine]) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage up to it (a
    client billing a stream cut short still knows what it got); without include_usage, none."""
    url, _ = server
    msgs = [{"role": "user", "content": "Count to ten."}]
    chunks = list(client(url).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is not None for c in chunks)
    tokens = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert tokens[0] == 0 and tokens == sorted(tokens) and tokens[-1] == 12
    assert len({c.usage.prompt_tokens for c in chunks if c.usage is not None}) == 1
    with_content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_content and all(c.usage is not None and c.usage.completion_tokens > 0 for c in with_content)
    plain = list(client(url).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is None for c in plain)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_over_two_tokens_never_reaches_the_client_in_part(server: tuple[str, AsyncEngine],
                                                                        offline: LLM, stream: bool) -> None:
    """A ReAct agent's "\nObservation:" is several tokens: the part of it in an earlier token's
    text must not have gone out by the time the later token shows it is a stop string. What
    the client gets is the offline engine's text before the stop string, streamed or whole."""
    url, _ = server
    prompt = "def fibonacci(n):"
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = offline.generate([prompt], free)[0].outputs[0].token_ids
    tok = offline.tokenizer
    texts = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # Two characters either side of a boundary between two tokens' texts (each of 2 or more).
    k = next(i for i in range(1, len(ids) - 1) if texts[i].startswith(texts[i - 1])
             and len(texts[i]) - len(texts[i - 1]) >= 2 and len(texts[i - 1]) >= 2
             and texts[i + 1].startswith(texts[i]))
    stop = texts[k - 1][-2:] + texts[k][len(texts[k - 1]):][:2]
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert want.outputs[0].finish_reason == "stop" and stop not in want.outputs[0].text
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client(url).completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        finish = [ch.finish_reason for ch in last]
    else:
        last = [client(url).completions.create(**kwargs).choices[0]]
        text, finish = last[0].text, [last[0].finish_reason]
    assert text == want.outputs[0].text, f"stop {stop!r}"
    assert finish == ["stop"]
    # vLLM's stop_reason: which stop string ended it (on a stream, its last chunk says)
    assert [getattr(ch, "stop_reason", "absent") for ch in last] == [stop]


def test_batched_prompts_number_choices_prompt_major(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    """OpenAI's batch form: a list of strings or of token-id lists; prompt p's
    sample j is choice p * n + j; usage counts every prompt once."""
    url, _ = server
    c = client(url)
    prompts = ["def f(x):", "import sys", "x = [1, 2"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].text for o in offline.generate(prompts, params)]
    resp = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2,
                                extra_body={"ignore_eos": True})
    assert [ch.index for ch in resp.choices] == list(range(6))
    assert [ch.text for ch in resp.choices] == [w for w in want for _ in range(2)]
    ids = [offline.tokenizer.encode(p) for p in prompts]
    assert resp.usage.prompt_tokens == sum(map(len, ids)) and resp.usage.completion_tokens == 48
    as_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [ch.text for ch in as_ids.choices] == want
    stream = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == want


def test_echo_puts_the_prompt_first(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    url, _ = server
    c = client(url)
    gen = offline.generate(["def g():"],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    resp = c.completions.create(model=MODEL, prompt="def g():", max_tokens=6, temperature=0, echo=True,
                                extra_body={"ignore_eos": True})
    assert resp.choices[0].text == "def g():" + gen
    stream = c.completions.create(model=MODEL, prompt="def g():", max_tokens=6, temperature=0, echo=True, stream=True,
                                  extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == "def g():" + gen


def test_echo_with_logprobs_scores_the_prompt(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    """What evaluation harnesses send for log-likelihoods: echo + logprobs (+ max_tokens 0):
    the prompt tokens' logprobs (the first None) before the generated ones'."""
    url, _ = server
    c = client(url)
    prompt = "def add(a, b): return a + b"
    ids = offline.tokenizer.encode(prompt)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                     prompt_logprobs=2))[0]
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expect = [None] + [e[t] for t, e in zip(ids[1:], want.prompt_logprobs[1:])] + \
        [e[t] for t, e in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert all(a is None and b is None or abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs, expect))
    assert resp.choices[0].text == prompt + want.outputs[0].text

    only = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length"
    assert len(only.choices[0].logprobs.tokens) == len(ids)
    assert only.choices[0].logprobs.token_logprobs[1:] == lp.token_logprobs[1:len(ids)]

    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  stream=True, extra_body={"ignore_eos": True})
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert chunks[0].text.startswith(prompt)
    assert [x for ch in chunks for x in ch.logprobs.token_logprobs] == lp.token_logprobs
    # text_offset: each reported token's first character in the choice's text, streamed or not.
    starts = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == starts
    assert [x for ch in chunks for x in ch.logprobs.text_offset] == starts
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sekret"}, timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("top", [None, 0, 1, 3])
def test_chat_logprobs_report_exactly_the_top_asked_for_with_bytes(server: tuple[str, AsyncEngine], top: int | None,
                                                                  ) -> None:
    """OpenAI's chat logprobs: `top_logprobs` entries per token, exactly as many as asked (none
    without it), each token with its UTF-8 `bytes`; sampled (here at a high temperature) the
    token itself is often not among them. Streamed the same."""
    url, _ = server
    kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                  temperature=1.5, seed=3, logprobs=True)
    if top is not None:
        kwargs["top_logprobs"] = top
    whole = client(url).chat.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client(url).chat.completions.create(stream=True, **kwargs))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert whole is not None and len(whole.content) == 12
    for entries in (whole.content, streamed):
        assert [len(e.top_logprobs) for e in entries] == [top or 0] * 12
        for e in entries:
            # the token's own bytes: its text where they are whole characters, U+FFFD where not
            assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
            assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in e.top_logprobs)
            lps = [t.logprob for t in e.top_logprobs]
            assert lps == sorted(lps, reverse=True)


def test_chat_stream_and_not(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    c = client(url)
    msgs = [{"role": "user", "content": "hello there"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert full.choices[0].message.role == "assistant"
    assert text == full.choices[0].message.content and full.usage.completion_tokens == 12


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, 10**6])
def test_a_bad_token_budget_is_named_as_the_client_gave_it(server: tuple[str, AsyncEngine], field: str,
                                                             value: int) -> None:
    """A client that sent max_completion_tokens (OpenAI's name) is told about that field."""
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer sekret"}, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and err["message"].startswith(field + ":")


def test_n_and_seed(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    c = client(url)
    a = c.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=1.0, n=3, seed=5)
    b = c.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=1.0, n=3, seed=5)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]


def test_logit_bias_and_penalties_reach_the_sampler(server: tuple[str, AsyncEngine], offline: LLM) -> None:
    """OpenAI's logit_bias (string token ids) and the penalties, through chat and completions."""
    url, _ = server
    c = client(url)
    forced = c.completions.create(model=MODEL, prompt="x = ", max_tokens=6, temperature=0.0,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == offline.tokenizer.decode([77] * 6)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0.0, logit_bias={"77": 100}, frequency_penalty=0.5)
    assert chat.choices[0].message.content == offline.tokenizer.decode([77] * 6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                            presence_penalty=0.5)
    want = offline.generate(["x = "], params)[0].outputs[0].text
    got = c.completions.create(model=MODEL, prompt="x = ", max_tokens=12, temperature=0.0, presence_penalty=0.5,
                               extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert got.choices[0].text == want


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 300}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [5] * 300}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi", "speculative": "maybe"}, 400, "speculative"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": ["ok", ""]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[5, 6], []]}, 400, "prompt"),
        ({"model": MODEL, "prompt": ["x"] * 65}, 400, "prompt"),
        ({"model": MODEL, "prompt": ["ok", "x" * 2000]}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(server: tuple[str, AsyncEngine], body: dict, status: int, param: str) -> None:
    url, engine = server
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["code"] == status
    assert engine.healthy


def test_api_key_required(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"}, timeout=10).json()
    assert models["data"][0]["id"] == MODEL
    # vLLM's card: its permission entry too (a client written for vLLM reads it)
    (perm,) = models["data"][0]["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] and perm["allow_logprobs"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_the_openai_client_retrieves_a_served_models_card(model_dir: Path) -> None:
    """OpenAI's GET /v1/models/{model} (`client.models.retrieve`): each served name's card, a
    name with a "/" included; another name is a NotFoundError naming the model."""
    from transformers import AutoTokenizer

    gw = Gateway(FakeBackend(), AutoTokenizer.from_pretrained(model_dir),
                 GatewayConfig(model_name="org/tiny-7b", aliases=("tiny",), max_model_len=256))
    with serve_gateway(gw, log_level="warning") as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for name in ("org/tiny-7b", "tiny"):
            card = c.models.retrieve(name)
            assert (card.id, card.object, card.owned_by) == (name, "model", "pdserve")
        with pytest.raises(openai.NotFoundError, match="`org/other` does not exist"):
            c.models.retrieve("org/other")


def test_openapi_describes_the_requests(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 401  # behind the API key, when one is set
    spec = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer sekret"}, timeout=10).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(spec["paths"])
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(spec["components"]["schemas"])
    # Each operation its own id (a client generator names its methods by them; /ping's GET and
    # POST shared one, and FastAPI warned of it at every start).
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def _wait_idle(engine: AsyncEngine, until: Callable[[], bool] = lambda: True, timeout_s: float = 10.0) -> None:
    """Until no request is in flight, no KV block is held and `until()` holds, or the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (engine.num_in_flight or engine.engine.kv.pool.num_used or not until()):
        time.sleep(0.05)


def _errors_499(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"}, timeout=30).text
    line = next((ln for ln in text.splitlines() if ln.startswith('pdserve:request_errors_total{code="499"}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_disconnected_stream_frees_its_blocks(server: tuple[str, AsyncEngine]) -> None:
    """A client that goes away, mid-stream or while waiting for a whole body: the
    request is aborted, its blocks freed, and it counts as a 499."""
    url, engine = server
    generated_before = engine.engine.stats.generation_tokens
    errors_before = _errors_499(url)
    # The requests must outlast the gateway's disconnect poll (0.25 s) on any machine: 240 tokens
    # of the tiny model take ~0.1 s on a fast one, and finished before the abort, so the steps are
    # slowed to 5 ms here (240 tokens: ~1.2 s).
    undo = slow_steps(engine.engine, 0.005)
    try:
        for _ in range(5):
            with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": "Bearer sekret"},
                              timeout=30, json={"model": MODEL, "prompt": "a b c", "max_tokens": 240,
                                                "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
            # leaving the block closes the connection mid-stream
        _wait_idle(engine)
        streamed = engine.engine.stats.generation_tokens - generated_before
        # Not streamed: the client gives up before the body comes.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sekret"}, timeout=0.05,
                       json={"model": MODEL, "prompt": "a b c", "max_tokens": 240, "n": 4, "ignore_eos": True})
        _wait_idle(engine)  # not scraping /metrics meanwhile: the event loop's turns as in service
        _wait_idle(engine, until=lambda: _errors_499(url) >= errors_before + 6)
    finally:
        undo()
    assert engine.num_in_flight == 0 and engine.engine.kv.pool.num_used == 0
    # Aborted, not run to completion: each part made well under half its 5 x 240 and 4 x 240
    # tokens (the gateway's poll notices the second client gone after ~0.25 s: ~50 steps).
    whole = engine.engine.stats.generation_tokens - generated_before - streamed
    assert streamed < 600 and whole < 480, (streamed, whole)
    assert _errors_499(url) == errors_before + 6


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_holds_over_http(server: tuple[str, AsyncEngine], offline: LLM,
                                                     stream: bool) -> None:
    """The OpenAI client's response_format (json_schema): the tiny random model's noise comes
    back as JSON that validates, whole or streamed, and greedy equals the offline engine
    under the same schema."""
    url, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "who?"}]
    if stream:
        chunks = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0.9,
                                                     seed=4, response_format=fmt, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        resp = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=200,
                                                   temperature=0.9, seed=4, response_format=fmt)
        assert resp.choices[0].finish_reason == "stop"
        text = resp.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON)

    resp = client(url).completions.create(model=MODEL, prompt="a person:", max_tokens=200, temperature=0,
                                          extra_body={"structured_outputs": {"json": PERSON}})
    want = offline.generate(["a person:"], SamplingParams(temperature=0, max_tokens=200,
                                                          structured_outputs={"json": PERSON}))[0]
    assert resp.choices[0].text == want.outputs[0].text and resp.choices[0].finish_reason == "stop"


def test_choice_and_regex_over_http(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    c = client(url)
    resp = c.completions.create(model=MODEL, prompt="answer:", max_tokens=10, temperature=1.0, n=4, seed=1,
                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {ch.text for ch in resp.choices} <= {"no", "yes"}  # (a set: sorted lists compared in order)
    resp = c.completions.create(model=MODEL, prompt="code:", max_tokens=10, temperature=1.0,
                                extra_body={"structured_outputs": {"regex": "[A-Z]{3}[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}[0-9]{2}", resp.choices[0].text)
    resp2 = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=100,
                                      temperature=0, response_format={"type": "json_object"})
    if resp2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp2.choices[0].message.content or ""), dict)


def test_the_openai_clients_parse_with_pydantic_models(server: tuple[str, AsyncEngine]) -> None:
    """`chat.completions.parse(response_format=Model)`: the client sends the model's strict JSON
    schema and parses the answer into it; the tiny random model's answers must parse, sampled."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        explanation: str = Field(max_length=12)
        output: int = Field(ge=-50, le=50)

    class Reasoning(BaseModel):
        steps: list[Step] = Field(max_length=3)
        final: Literal["yes", "no"]
        ok: bool

    url, _ = server
    c = client(url)
    for seed in range(6):
        resp = c.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "think"}],
                                        response_format=Reasoning, max_tokens=200, temperature=1.0, seed=seed)
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(resp.choices[0].message.parsed, Reasoning)
