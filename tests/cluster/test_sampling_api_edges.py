"""How the OpenAI requests' sampling fields reach SamplingParams, past the happy path: a
refusal is a 400 whose OpenAI error object names the field the client sent. Each test
failed before its fix."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from factories import tiny_engine_url, tiny_spec

from pdserve.workers.tiny.builder import TinyModelSpec

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def url(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[str]:
    with tiny_engine_url(make_model(tiny_spec(init_std=0.05)), max_model_len=128) as base:
        yield base


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/v1", timeout=60)


@pytest.mark.parametrize(("top_logprobs", "logprobs"), [(-1, True), (21, True), (-5, None), (-(2**63) - 1, False)])
def test_a_bad_top_logprobs_is_named_top_logprobs(url: str, top_logprobs: int, logprobs: bool | None) -> None:
    """Chat asks for N top logprobs with `top_logprobs` (`logprobs` is a boolean there): a bad N
    was refused as "logprobs: ..." with param "logprobs", a field the client had set right; a
    negative one without `logprobs` was taken (vLLM refuses it either way)."""
    with _client(url) as c:
        r = c.post("/chat/completions", json={**CHAT, "logprobs": logprobs, "top_logprobs": top_logprobs})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "top_logprobs" and err["message"].startswith("top_logprobs: "), err
    assert err["code"] == 400 and err["type"] == "BadRequestError"


def test_completions_still_name_logprobs(url: str) -> None:
    with _client(url) as c:
        r = c.post("/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_top_logprobs_zero_without_logprobs_is_taken_as_vllm_takes_it(url: str) -> None:
    """`top_logprobs: 0` asks for no alternatives: vLLM takes it without `logprobs`; pdserve
    answered 400. Above 0 it still needs `logprobs: true`."""
    with _client(url) as c:
        zero = c.post("/chat/completions", json={**CHAT, "top_logprobs": 0})
        some = c.post("/chat/completions", json={**CHAT, "top_logprobs": 2})
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None, zero.text
    assert some.status_code == 400 and some.json()["error"]["param"] == "top_logprobs", some.text


def test_allowed_token_ids_and_bad_words_reach_the_engine(url: str) -> None:
    """vLLM's extensions were refused as unknown fields: now the output holds only the allowed
    tokens, and a word of the plain output is gone from it."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        texts = {c.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (40, 41)}
        allowed = c.post("/v1/completions", json={**body, "allowed_token_ids": [40, 41]})
        plain = c.post("/v1/completions", json=body).json()["choices"][0]
        word = "".join(plain["logprobs"]["tokens"][1:3]).strip() or plain["logprobs"]["tokens"][1]
        banned = c.post("/v1/completions", json={**body, "bad_words": [word]})
    assert allowed.status_code == 200, allowed.text
    tokens = allowed.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= texts, (tokens, texts)
    assert banned.status_code == 200 and banned.json()["choices"][0]["text"] != plain["text"], (word, banned.text)


@pytest.mark.parametrize(("field", "value"), [("allowed_token_ids", []), ("allowed_token_ids", [3, 10**6]),
                                              ("bad_words", ["w"] * 129), ("bad_words", [""])])
def test_bad_vocabulary_restrictions_are_a_400_naming_the_field(url: str, field: str, value: object) -> None:
    with _client(url) as c:
        r = c.post("/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_restrictions_that_leave_no_token_are_the_clients_400(url: str) -> None:
    """Its one allowed token is a stop token, banned under min_tokens: the request cannot go on.
    That was the server's own error (no finite logits); it is the client's contradiction."""
    with _client(url) as c:
        r = c.post("/completions", json={"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [40],
                                         "allowed_token_ids": [40]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_truncate_prompt_tokens_answers_the_prompts_tail(url: str) -> None:
    """A prompt longer than the context was a 400; with vLLM's truncate_prompt_tokens its last N
    tokens are the prompt (usage counts them), on completions and chat; too many is a 400."""
    long = list(range(5, 205)) * 2  # 400 tokens, max_model_len 128
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with _client(url) as c:
        cut = c.post("/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 100})
        tail = c.post("/completions", json={**body, "prompt": long[-100:]})
        whole = c.post("/completions", json={**body, "prompt": long})
        chat = c.post("/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi " * 300}],
                                                 "truncate_prompt_tokens": 20})
        over = c.post("/completions", json={**body, "prompt": long, "truncate_prompt_tokens": 129})
    assert cut.status_code == 200 and whole.status_code == 400, (cut.text, whole.text)
    assert cut.json()["choices"][0]["text"] == tail.json()["choices"][0]["text"]
    assert cut.json()["usage"]["prompt_tokens"] == 100
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 20, chat.text
    assert over.status_code == 400 and over.json()["error"]["param"] == "truncate_prompt_tokens", over.text


def _logprob_tokens(url: str, **fields: object) -> tuple[list[str], list[dict[str, object]]]:
    """A completion's and a chat's logprob tokens (their names), of the same greedy request."""
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, **fields}
    with _client(url) as c:
        done = c.post("/completions", json={**base, "prompt": [5, 6, 7], "logprobs": 2}).json()
        chat = c.post("/chat/completions", json={**base, **CHAT, "max_tokens": 5, "logprobs": True,
                                                 "top_logprobs": 2}).json()
    return done["choices"][0]["logprobs"]["tokens"], chat["choices"][0]["logprobs"]["content"]


def test_return_tokens_as_token_ids_names_each_token_by_its_id(url: str) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens `token_id:<id>` (RL clients
    rebuild the exact ids from them), the bytes those of the name; it was refused."""
    text_tokens, text_content = _logprob_tokens(url)
    id_tokens, id_content = _logprob_tokens(url, return_tokens_as_token_ids=True)
    assert len(id_tokens) == len(text_tokens) == 5 and all(t.startswith("token_id:") for t in id_tokens)
    with httpx.Client(base_url=url, timeout=60) as c:
        for named, text in zip(id_tokens, text_tokens):
            assert c.post("/detokenize", json={"tokens": [int(named[9:])]}).json()["prompt"] == text
    for got, plain in zip(id_content, text_content):
        assert got["logprob"] == plain["logprob"] and got["bytes"] == list(str(got["token"]).encode())
        assert str(got["token"]).startswith("token_id:")
        assert all(str(t["token"]).startswith("token_id:") for t in got["top_logprobs"])  # type: ignore[attr-defined]


def test_the_servers_return_tokens_as_token_ids_is_a_default_a_request_overrides(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    with tiny_engine_url(make_model(tiny_spec(init_std=0.05)), max_model_len=128,
                         return_tokens_as_token_ids=True) as base:
        by_default, _ = _logprob_tokens(base)
        asked_text, _ = _logprob_tokens(base, return_tokens_as_token_ids=False)
    assert all(t.startswith("token_id:") for t in by_default)
    assert not any(t.startswith("token_id:") for t in asked_text)


def test_max_logprobs_raises_the_bound_on_logprobs(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """vLLM's --max-logprobs: past 20 log-probs a token (distillation, RL) was a 400 whatever the
    server said; -1 lets a request ask for the whole vocabulary. The engine takes what the gateway does."""
    # (named by id: a completion's top_logprobs is keyed by token text, which two tokens may share)
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "logprobs": 40, "return_tokens_as_token_ids": True}
    with tiny_engine_url(make_model(tiny_spec(init_std=0.05)), max_model_len=128, engine={"max_logprobs": -1},
                         max_logprobs=-1) as base, httpx.Client(base_url=base + "/v1", timeout=60) as c:
        wide = c.post("/completions", json=body)
        chat = c.post("/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 40})
    assert wide.status_code == 200, wide.text
    assert all(len(e) >= 40 for e in wide.json()["choices"][0]["logprobs"]["top_logprobs"])
    assert chat.status_code == 200 and len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 40
