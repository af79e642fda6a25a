"""The gateway tokenizes in a pool sized to the cores, in two lanes: a short prompt's
tokenization never queues behind a long one's (cluster/tokenizer_pool.py). The long
tokenizations here block on an event until the test releases them, so "behind" is
decided by what completes, not by timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, tiny_spec

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.tokenizer_pool import INLINE_CHARS, SHORT_CHARS, TokenizerPool, available_cores
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"
WAIT_S = 10.0  # the most any step here waits


class Backend(FakeBackend):
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> Any:
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7], finish_reason="length")],
                            finished=True)


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec()))


def test_the_pool_has_a_lane_of_threads_per_core_for_each_size() -> None:
    pool = TokenizerPool()
    try:
        assert pool.threads == available_cores() and pool.long_threads == max(1, pool.threads - 1)
        assert pool.lane(SHORT_CHARS) is not pool.lane(SHORT_CHARS + 1)
        single = TokenizerPool(1, 0)  # the old gateway: one thread, first come first served
        assert single.lane(1) is single.lane(10**9)
        single.shutdown()
    finally:
        pool.shutdown()
    with pytest.raises(ValueError, match="^threads: must be >= 1"):
        TokenizerPool(0)


async def _short_done_while_long_blocked(pool: TokenizerPool) -> bool:
    """A long job holds every long-lane thread; does a short job finish meanwhile?"""
    release = threading.Event()
    longs = [asyncio.ensure_future(pool.run(SHORT_CHARS + 1, lambda: release.wait(WAIT_S)))
             for _ in range(pool.long_threads)]
    short = asyncio.ensure_future(pool.run(INLINE_CHARS + 1, lambda: "short"))  # short, but not run inline
    done, _ = await asyncio.wait({short}, timeout=0.5)  # only bounds the wait of the single-lane case
    release.set()
    await asyncio.gather(short, *longs)
    return bool(done)


def test_a_short_job_does_not_queue_behind_long_ones() -> None:
    two_lanes, one_lane = TokenizerPool(2), TokenizerPool(1, 0)
    try:
        assert asyncio.run(_short_done_while_long_blocked(two_lanes))
        assert not asyncio.run(_short_done_while_long_blocked(one_lane))  # what the lanes are for
    finally:
        two_lanes.shutdown()
        one_lane.shutdown()


class Blocking:
    """The tokenizer with its long encodes held until `release` (short ones pass)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
        self.release, self.long_started = threading.Event(), threading.Event()
        real = tokenizer.encode

        def encode(text: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(text, str) and len(text) > SHORT_CHARS:
                self.long_started.set()
                assert self.release.wait(WAIT_S), "the test never released the long prompt"
            return real(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, "encode", encode)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_short_request_is_served_while_a_long_one_tokenizes(tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
                                                              path: str) -> None:
    gw = Gateway(Backend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=4096), TokenizerPool(1))
    blocking = Blocking(monkeypatch, tokenizer)

    def body(text: str) -> dict[str, Any]:
        if path == "/v1/chat/completions":
            return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        return {"model": MODEL, "prompt": text, "max_tokens": 1}

    async def main() -> tuple[httpx.Response, bool]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=WAIT_S) as c:
            # Long, and under the bound (the tiny tokenizer: 41 characters a token at most).
            long = asyncio.ensure_future(c.post(path, json=body("abcdefg " * (SHORT_CHARS // 7))))
            assert await asyncio.to_thread(blocking.long_started.wait, WAIT_S)
            short = await c.post(path, json=body("hi"))
            still_tokenizing = not long.done()
            blocking.release.set()
            await long
            return short, still_tokenizing

    try:
        short, still_tokenizing = asyncio.run(main())
    finally:
        gw.pool.shutdown()
    assert short.status_code == 200 and still_tokenizing


def test_a_short_job_runs_on_the_loop_and_a_long_or_grammar_one_on_a_thread() -> None:
    """The hop to a thread costs more than a short tokenization: a short job runs on the
    loop; a long one, or one told it may compile a grammar, runs on the pool's threads."""
    pool = TokenizerPool(2)

    async def where(size: int, may_inline: bool = True) -> str:
        return await pool.run(size, lambda: threading.current_thread().name, may_inline)

    async def main() -> tuple[str, str, str, str]:
        return (await where(INLINE_CHARS), await where(INLINE_CHARS + 1), await where(10, may_inline=False),
                threading.current_thread().name)

    try:
        short, long, grammar, loop = asyncio.run(main())
        off = TokenizerPool(1, inline_chars=0)
        try:
            never = asyncio.run(off.run(1, lambda: threading.current_thread().name))
        finally:
            off.shutdown()
    finally:
        pool.shutdown()
    assert short == loop
    assert long != loop and long.startswith("pdserve-tokenize")
    assert grammar != loop and grammar.startswith("pdserve-tokenize")
    assert never.startswith("pdserve-tokenize")
    with pytest.raises(ValueError, match="^inline_chars: must be >= 0"):
        TokenizerPool(1, inline_chars=-1)


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"regex": "[ab]+"}},
                                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}])
def test_a_request_that_may_compile_a_grammar_tokenizes_on_a_thread(tokenizer: Any, extra: dict[str, Any]) -> None:
    from pdserve.cluster.gateway import compiles_grammar
    from pdserve.cluster.protocol import ChatCompletionRequest, CompletionRequest

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert not compiles_grammar(ChatCompletionRequest.model_validate(chat))
    assert not compiles_grammar(CompletionRequest.model_validate({"model": MODEL, "prompt": "hi"}))
    assert compiles_grammar(ChatCompletionRequest.model_validate({**chat, **extra}))
    if "tools" not in extra:
        assert compiles_grammar(CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", **extra}))


@pytest.mark.parametrize(("path", "body", "inline"), [
    ("/v1/completions", {"prompt": "hi"}, True),
    ("/v1/completions", {"prompt": "abcdefg " * 80}, False),  # 640 characters
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    # Short texts, but a template over many messages costs what a long prompt does (~20 us a message).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 40}, False),
    # /tokenize renders the same template: the same work, the same place.
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}] * 40}, False),
])
def test_the_gateway_tokenizes_only_short_work_on_its_loop(tokenizer: Any, monkeypatch: pytest.MonkeyPatch, path: str,
                                                          body: dict[str, Any], inline: bool) -> None:
    gw = Gateway(Backend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=4096), TokenizerPool(2))
    real, threads = tokenizer.encode, []

    def encode(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)

    async def main() -> tuple[httpx.Response, str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=WAIT_S) as c:
            budget = {} if path == "/tokenize" else {"max_tokens": 1}  # /tokenize takes no sampling field
            return await c.post(path, json={"model": MODEL, **budget, **body}), threading.current_thread().name

    try:
        r, loop = asyncio.run(main())
    finally:
        gw.pool.shutdown()
    assert r.status_code == 200, r.text
    assert threads and all((t == loop) is inline for t in threads), (threads, loop)


def test_a_request_whose_tokenizing_outlasts_its_deadline_is_a_504_and_frees_its_slot(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing is part of the request's deadline, its wait in the lane's queue included:
    past it the client gets a 504 (not a wait with no end), and its admission slot is free
    again while the tokenizer is still busy."""
    gw = Gateway(Backend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=4096, request_timeout_s=0.5),
                 TokenizerPool(1))
    blocking = Blocking(monkeypatch, tokenizer)

    async def main() -> tuple[httpx.Response, float, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=WAIT_S) as c:
            started = asyncio.get_running_loop().time()
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "abcdefg " * (SHORT_CHARS // 7),
                                                      "max_tokens": 1})
            took, admitted = asyncio.get_running_loop().time() - started, gw.admitted
            blocking.release.set()
            return r, took, admitted

    try:
        r, took, admitted = asyncio.run(main())
    finally:
        gw.pool.shutdown()
    assert r.status_code == 504 and r.json()["error"]["code"] == 504, r.text
    assert took < 5.0 and admitted == 0 and blocking.long_started.is_set()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_waiting_for_its_grammar_holds_no_tokenizer_thread(tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      path: str) -> None:
    """A grammar compiles on the compiler's own threads; its request waited for it on a tokenizer
    thread, up to the compile deadline (10 s), so with a slow grammar per thread every other
    request's tokenizing (a prompt over INLINE_CHARS) waited behind them."""
    from pdserve.workers.grammar import GrammarCompiler

    gw = Gateway(Backend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=4096), TokenizerPool(1))
    release, started = threading.Event(), threading.Event()
    real = GrammarCompiler._compile

    def stuck(self: GrammarCompiler, spec: Any) -> Any:
        started.set()
        assert release.wait(WAIT_S), "the test never released the grammar"
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", stuck)

    def body(text: str, **extra: Any) -> dict[str, Any]:
        if path == "/v1/chat/completions":
            return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1, **extra}
        return {"model": MODEL, "prompt": text, "max_tokens": 1, **extra}

    async def main() -> tuple[httpx.Response, httpx.Response, bool]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gw)), base_url="http://gw",
                                     timeout=WAIT_S) as c:
            slow = asyncio.ensure_future(c.post(path, json=body("hi", structured_outputs={"regex": "[ab]{3}"})))
            assert await asyncio.to_thread(started.wait, WAIT_S)
            plain = asyncio.ensure_future(c.post(path, json=body("abcdefg " * 80)))  # 640 characters: a thread's
            done, _ = await asyncio.wait({plain}, timeout=WAIT_S / 2)
            release.set()
            return await plain, await slow, bool(done)

    try:
        plain, slow, plain_first = asyncio.run(main())
    finally:
        release.set()
        gw.pool.shutdown()
        if gw._grammars is not None:
            gw._grammars.close()
    assert plain_first, "the plain request waited for another request's grammar"
    assert plain.status_code == 200 and slow.status_code == 200, (plain.text, slow.text)
