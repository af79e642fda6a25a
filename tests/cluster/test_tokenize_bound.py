"""A prompt surely too long for the context is refused before it is tokenized: text by
its characters (cluster/prompt_bound.py), token ids by their count, chat messages by
their text and then by the rendered template; the 400 names the field, as the same
refusal after tokenizing does."""

from __future__ import annotations

import asyncio
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, tiny_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.prompt_bound import MAX_COMPOSITION, CharBound, char_bound
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"
MAX_MODEL_LEN = 256
HUGE = 15 << 20  # characters: a prompt just under the default --max-body-bytes (16 MiB)


class Backend(FakeBackend):
    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float) -> Any:
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7], finish_reason="length")],
                            finished=True)


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec()))


class Spy:
    """Counts the tokenizer's calls that cost time with the prompt's length."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
        self.calls: list[str] = []
        for name in ("encode", "apply_chat_template", "__call__"):
            real = getattr(tokenizer, name)
            monkeypatch.setattr(tokenizer, name, self._wrap(name, real))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return real(*args, **kwargs)

        return spy


def post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as c:
            return await c.post(path, json=body)

    return asyncio.run(main())


def gateway(tokenizer: Any) -> Gateway:
    return Gateway(Backend(), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=MAX_MODEL_LEN))


def assert_too_long(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400
    assert error["message"].startswith(f"{param}: this model's maximum context length is {MAX_MODEL_LEN} tokens")


def test_max_composition_is_unicodes_longest_canonical_decomposition() -> None:
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c < 0xE000)
    assert MAX_COMPOSITION == longest


def test_a_huge_prompt_is_refused_without_tokenizing(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gw = gateway(tokenizer)
    bound = gw.char_bound
    assert bound is not None and bound.chars_per_token == max(map(len, tokenizer.get_vocab()))
    spy = Spy(monkeypatch, tokenizer)
    assert_too_long(post(gw, "/v1/completions", {"model": MODEL, "prompt": "a" * HUGE, "max_tokens": 4}), "prompt")
    batch = ["hi", "b" * (bound.max_chars + 1)]  # one prompt of a batch is enough
    assert_too_long(post(gw, "/v1/completions", {"model": MODEL, "prompt": batch}), "prompt")
    chat = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "c" * HUGE}]}]}
    assert_too_long(post(gw, "/v1/chat/completions", chat), "messages")
    assert spy.calls == []
    refused = {s.labels["reason"]: s.value for s in gw.metrics.refused.collect()[0].samples
               if s.name.endswith("_total")}
    assert refused["malformed"] == 3  # as the same refusal after tokenizing


def test_token_ids_are_counted_before_anything_else(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too many ids is the refusal, even when they are outside the vocabulary too."""
    gw = gateway(tokenizer)
    spy = Spy(monkeypatch, tokenizer)
    r = post(gw, "/v1/completions", {"model": MODEL, "prompt": [10**9] * MAX_MODEL_LEN})
    assert_too_long(r, "prompt")
    assert "the prompt has 256" in r.json()["error"]["message"]
    assert post(gw, "/v1/completions", {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN - 8),
                                        "max_tokens": 4}).status_code == 200
    assert spy.calls == []


def test_the_bound_refuses_no_prompt_that_fits(tokenizer: Any) -> None:
    """The longest token's text, repeated: as many characters per token as the bound
    allows. Such a prompt of max_model_len - 8 tokens is served."""
    gw = gateway(tokenizer)
    vocab = tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = tokenizer.decode([vocab[longest]])
    prompt = text * (MAX_MODEL_LEN - 8)
    assert len(tokenizer.encode(prompt, add_special_tokens=False)) <= MAX_MODEL_LEN - 8
    assert len(prompt) > MAX_MODEL_LEN * 8  # far more characters than a plain-text guess would allow
    assert post(gw, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}).status_code == 200


def test_a_chat_too_long_once_tokenized_names_messages(tokenizer: Any) -> None:
    """Under the character bound, over max_model_len in tokens: refused after tokenizing, naming
    the chat's own field (it named `prompt`, a field a chat request does not have)."""
    gw = gateway(tokenizer)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * MAX_MODEL_LEN}]}
    assert gw.char_bound is not None and len(chat["messages"][0]["content"]) < gw.char_bound.max_chars
    assert_too_long(post(gw, "/v1/chat/completions", chat), "messages")
    assert_too_long(post(gw, "/v1/completions", {"model": MODEL, "prompt": chat["messages"][0]["content"]}),
                    "prompt")


def test_the_rendered_chat_is_bounded_too(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages under the bound whose template makes them longer: refused after rendering,
    before encoding."""
    gw = gateway(tokenizer)
    assert gw.char_bound is not None
    room = gw.char_bound.max_chars
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                             add_generation_prompt=True)
    spy = Spy(monkeypatch, tokenizer)
    content = "d" * (room - len(rendered) + 1)  # fits alone; with the template's text it does not
    assert_too_long(post(gw, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                     "content": content}]}),
                    "messages")
    assert spy.calls == ["apply_chat_template"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(["\n" + " " * 40, " " * 200, "\t" * 9, "é" * 7,
                                                                 "\U0001f469\u200d\U0001f4bb"])), max_size=30))
def test_a_text_makes_at_least_its_characters_over_the_bound_in_tokens(tokenizer: Any, parts: list[str]) -> None:
    bound = char_bound(tokenizer, MAX_MODEL_LEN)
    assert bound is not None
    text = "".join(parts)
    assert len(tokenizer.encode(text, add_special_tokens=False)) * bound.chars_per_token >= len(text)


def _bpe(normalizer: Any = None) -> Any:
    """A small byte-level BPE, optionally behind `normalizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "the cat sat on the mat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_that_composes_gets_a_wider_bound_and_one_that_drops_none() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    plain, nfc = _bpe(), _bpe(normalizers.NFC())
    longest = max(map(len, plain.get_vocab()))
    assert char_bound(plain, MAX_MODEL_LEN) == CharBound(longest, MAX_MODEL_LEN)
    assert char_bound(nfc, MAX_MODEL_LEN) == CharBound(max(map(len, nfc.get_vocab())) * MAX_COMPOSITION,
                                                       MAX_MODEL_LEN)
    # Why composition widens it: NFC cuts four characters into one before tokenizing.
    assert nfc.decode(nfc.encode("\u03b1\u0313\u0300\u0345", add_special_tokens=False)) == "\u1f82"
    # A word-level tokenizer drops whitespace: 10,000 spaces are no tokens at all.
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    lossy = PreTrainedTokenizerFast(tokenizer_object=words)
    assert len(lossy.encode("a" + " " * 10_000 + "b", add_special_tokens=False)) == 2
    assert char_bound(lossy, MAX_MODEL_LEN) is None
    assert char_bound(object(), MAX_MODEL_LEN) is None  # not an HF tokenizer: no bound, no error
