"""Structured outputs and tool calls past the happy path, against the OpenAI / vLLM contract."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from factories import FakeBackend, serve_gateway, tiny_engine_url, tiny_spec

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

ASK = [{"role": "user", "content": "weather in Paris?"}]
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SPEC = dict(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05)


@pytest.fixture(scope="module")
def url(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[str]:
    with tiny_engine_url(make_model(tiny_spec(**SPEC))) as base:
        yield base


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


# A tool whose parameters refer to their own $defs: what pydantic's model_json_schema() (and so
# openai.pydantic_function_tool) writes for any model with a nested model.
DEFS_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}],
                         ids=["required", "named"])
def test_tool_with_defs_is_served_under_required_as_under_named(url: str, choice: Any) -> None:
    resp = client(url).chat.completions.create(model="tiny", messages=ASK, tools=[DEFS_TOOL], tool_choice=choice,
                                               max_tokens=200, temperature=0)
    calls = resp.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "book" for c in calls)


def test_min_tokens_past_a_grammars_end_is_not_a_500(url: str) -> None:
    """docs/api.md: 'A request stops when its grammar is complete (finish_reason "stop", also
    under ignore_eos)'. With min_tokens past the grammar's end, EOS is banned while the
    grammar allows only EOS."""
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Answer:", "max_tokens": 16,
                                                    "min_tokens": 8, "temperature": 0,
                                                    "structured_outputs": {"choice": ["yes", "no"]}}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop", choice


# -- a scripted model (the model's text given), for what the gateway makes of it ------------

TWO_TOOLS: list[dict[str, Any]] = [*TOOLS, {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')


class Scripted(FakeBackend):
    """Streams a fixed answer a few characters a delta. `special`: text of special tokens in it,
    left out when the request skips special tokens' text (what the engine's detokenizer does)."""

    def __init__(self, text: str, special: tuple[str, ...] = ()) -> None:
        self.text, self.special = text, special
        self.seen: list[SamplingParams] = []

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.seen.append(params)
        text = self.text
        if params.skip_special_tokens:
            for s in self.special:
                text = text.replace(s, "")
        pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, piece, [7], None, None,
                                                                            "stop" if last else None)], last)


@pytest.fixture(scope="module")
def tokenizer(make_model: Callable[[TinyModelSpec], Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_model(tiny_spec(**SPEC)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_gives_at_most_one_call_under_auto(tokenizer: Any, stream: bool) -> None:
    """OpenAI: parallel_tool_calls false, at most one call; vLLM keeps the first
    (entrypoints/openai/utils.py maybe_filter_parallel_tool_calls)."""
    gw = Gateway(Scripted(TWO_CALLS), tokenizer, GatewayConfig(model_name="tiny", max_model_len=1024))
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TWO_TOOLS, tool_choice="auto",
                                  parallel_tool_calls=False, max_tokens=100)
    with serve_gateway(gw) as base:
        if stream:
            chunks = list(client(base).chat.completions.create(stream=True, **kwargs))
            calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        else:
            calls = client(base).chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    assert len(calls) == 1, [c.function.name for c in calls]


MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'


def test_mistral_call_marker_survives_special_token_skipping(tokenizer: Any) -> None:
    """[TOOL_CALLS] is a special token in Mistral's tokenizers: with skip_special_tokens (the
    default) its text never reaches the parser, so the call comes back as content. vLLM's
    and SGLang's tool parsers set skip_special_tokens false when tools are active."""
    import copy

    from pdserve.workers.detokenizer import IncrementalDetokenizer

    tok = copy.deepcopy(tokenizer)  # the engine's own detokenizer drops a special token's text when told to
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tok.encode(MISTRAL_CALL, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, tok.encode("hi"), [], False, skip_special_tokens=True)
    for t in ids:
        detok.add(t)
    assert detok.text == MISTRAL_CALL.removeprefix("[TOOL_CALLS]")
    backend = Scripted(MISTRAL_CALL, special=("[TOOL_CALLS]",))  # so the scripted model's text drops it too
    gw = Gateway(backend, tokenizer, GatewayConfig(model_name="tiny", max_model_len=1024))
    with serve_gateway(gw) as base:
        resp = client(base).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
    assert resp.choices[0].message.tool_calls, (resp.choices[0].message.content, backend.seen[0].skip_special_tokens)


# The constructs of the Hermes tool-use chat template (NousResearch Hermes-2-Pro/Hermes-3,
# vLLM's examples/tool_chat_template_hermes.jinja): `parameters.properties|items` and
# `" - " + description`.
HERMES_LIKE = (
    "{%- for tool in tools or [] %}{%- set f = tool.function %}"
    "{{- f.name + '(' }}{%- for k, v in f.parameters.properties|items %}{{- k }}{%- endfor %}"
    "{{- ') - ' + f.description + '\\n' }}{%- endfor %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("fn", [
    {"name": "get_time", "description": "t", "parameters": {"type": "object", "properties": ["zone"]}},
    {"name": "get_time", "description": None, "parameters": {"type": "object", "properties": {}}},
], ids=["properties-a-list", "description-null"])
def test_a_tool_the_template_cannot_render_is_a_400_not_a_500(tokenizer: Any, fn: dict[str, Any]) -> None:
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HERMES_LIKE
    gw = Gateway(Scripted("hi"), tok, GatewayConfig(model_name="tiny", max_model_len=1024))
    with serve_gateway(gw) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4,
                                                             "tools": [{"type": "function", "function": fn}]},
                       timeout=60)
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("spec", [
    {"regex": "[^\\s\\S]"},
    {"grammar": "root ::= root \"a\""},
    {"json": {"type": "string", "pattern": "[^\\s\\S]"}},
    {"json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1.5, "maximum": 1.7}},
              "required": ["a"]}},
    {"json": {"type": "integer", "multipleOf": 0}},
], ids=["regex-empty-class", "left-recursive", "pattern-empty-class", "int-range-empty", "multipleOf-0"])
def test_a_spec_nothing_can_match_is_not_a_500(url: str, spec: dict[str, Any]) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Answer:", "max_tokens": 8,
                                                    "temperature": 0, "structured_outputs": spec}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_spec_that_dead_ends_after_its_first_token_is_the_clients_error(url: str, stream: bool) -> None:
    """It compiles and allows a first token, then nothing: the engine fails the request alone,
    as the client's spec (400, in-band when streamed), not as an engine fault (500); the
    engine goes on serving."""
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 8, "temperature": 0, "stream": stream,
            "structured_outputs": {"regex": "a[^\\s\\S]"}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert errors and errors[-1]["code"] == 400, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
    assert "structured_outputs" in r.text and "no output can match it" in r.text
    ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Answer:", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_json_answer_that_only_names_a_tool_is_not_a_call() -> None:
    """Llama 3.x's format is {"name", "parameters"}; vLLM's llama3_json parser needs the
    arguments ("parameters" or "arguments") and otherwise returns the text as content. Here a
    JSON answer that merely has a "name" key equal to a tool's name becomes a call with
    arguments "{}", and its other fields are lost."""
    from pdserve.cluster.tool_calls import ToolPlan

    text = '{"name": "get_time", "note": "the tool I would use"}'
    content, calls = ToolPlan.of(TOOLS, "auto", None).parse(text)
    assert (content, calls) == (text, []), calls


def test_a_malformed_hermes_call_is_not_silently_dropped() -> None:
    """Two calls, the second not JSON: one call comes back and the second's text is in
    neither the calls nor the content (vLLM's hermes parser returns the whole text as content)."""
    from pdserve.cluster.tool_calls import ToolPlan

    text = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"</tool_call>')
    content, calls = ToolPlan.of(TOOLS, "auto", None).parse(text)
    assert not calls or (content is not None and "CET" in content), (content, calls)


class Prompts(Scripted):
    """Scripted, and keeps each request's prompt ids."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        async for out in super().generate(request_id, prompt, params, timeout_s):
            yield out


@pytest.mark.parametrize("exclude", [False, True], ids=["default", "excluded"])
def test_tool_choice_none_still_shows_the_model_its_tools(tokenizer: Any, exclude: bool) -> None:
    """OpenAI's `tool_choice: "none"` keeps the tools in the model's context and only forbids
    calls; vLLM renders them too unless --exclude-tools-when-tool-choice-none. The oracle is the
    template itself: the prompt is the template rendered with (or without) the tools."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HERMES_LIKE
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "description": "the time"}}]
    backend = Prompts("<tool_call>not parsed</tool_call>")
    gw = Gateway(backend, tok, GatewayConfig(model_name="tiny", max_model_len=1024,
                                             exclude_tools_when_tool_choice_none=exclude))
    with serve_gateway(gw) as base:
        none = client(base).chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="none",
                                                    max_tokens=20).choices[0]
        client(base).chat.completions.create(model="tiny", messages=ASK, tools=tools, max_tokens=20)
    shown = tok.apply_chat_template(ASK, tools=tools, tokenize=False, add_generation_prompt=True)
    hidden = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    assert "get_time(" in shown and "get_time(" not in hidden
    want = hidden if exclude else shown
    assert backend.prompts[0] == tok.encode(want, add_special_tokens=False)
    assert backend.prompts[1] == tok.encode(shown, add_special_tokens=False)  # auto: always shown
    # Under none the answer is text, whatever it looks like.
    assert none.message.tool_calls is None and none.message.content == "<tool_call>not parsed</tool_call>"


# -- found by checking streamed answers against whole ones over ~10k random splits ---------------


def test_words_before_a_later_format_stream_as_the_whole_answer_has_them(tokenizer: Any) -> None:
    """With every format parsed (no --tool-call-parser), a Hermes call wins over a "[TOOL_CALLS]"
    in the words before it: the whole answer's content runs to `<tool_call>`. The stream stopped
    its words at the first marker it met and, at the end, sent none of those after it."""
    text = 'Use [TOOL_CALLS] like this. <tool_call>{"name": "get_time", "arguments": {"zone": "X"}}</tool_call>'
    gw = Gateway(Scripted(text), tokenizer, GatewayConfig(model_name="tiny", max_model_len=1024))
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
    with serve_gateway(gw) as base:
        chunks = list(client(base).chat.completions.create(stream=True, **kwargs))
        whole = client(base).chat.completions.create(**kwargs).choices[0]
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert whole.message.content == "Use [TOOL_CALLS] like this. "
    assert "".join(d.content or "" for d in deltas) == whole.message.content
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "X"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.finish_reason


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_time", "arguments": {"zone": 1e999}}</tool_call>',  # a float past its range
    '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": -1e400}}]',
    '{"name": "get_time", "parameters": {"zone": 1E309}}',
    '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": null}</tool_call>',
    # a call to a tool the request does not have, beside one it has: it vanished, the other went
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "A"}}</tool_call>',
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
])
def test_a_call_whose_arguments_are_not_a_json_object_or_whose_tool_is_unknown_is_content(text: str) -> None:
    """A call's arguments go to the client as the JSON text of an object: 1e999 came out as
    `Infinity` (Python's parser reads it as a float's infinity), "not json" as itself, 5 as "5".
    Such an answer, and one that calls a tool the request lacks, stays words, as a call that does
    not parse does (vLLM's parsers return the text as content where a call does not parse)."""
    from pdserve.cluster.tool_calls import ToolPlan

    assert ToolPlan.of(TOOLS, "auto", None).parse(text) == (text, [])


def test_arguments_given_as_the_json_text_of_an_object_are_kept_as_written() -> None:
    from pdserve.cluster.tool_calls import ToolPlan

    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    content, calls = ToolPlan.of(TOOLS, "auto", None).parse(text)
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"zone": "UTC"}']
