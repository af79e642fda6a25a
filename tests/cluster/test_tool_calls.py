"""Tool calls (cluster/tool_calls.py) through the OpenAI client: `required` and a named function
are enforced by a grammar, so even the tiny random model returns calls that parse and whose
arguments validate against the tool's schema, whole and streamed; `auto` parses the model's own
format (Hermes/Qwen2.5, Mistral, Llama 3.x); bad tool fields are 400s naming them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from factories import FakeBackend, serve_gateway, tiny_engine_url, tiny_spec

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.tool_calls import ToolPlan, parse_calls, template_messages
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def url(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[str]:
    with tiny_engine_url(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))) as base:
        yield base


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_calls_parse_and_validate(url: str, stream: bool) -> None:
    """Calls the model chose ("required") finish with "tool_calls"; a call the request named
    finishes with "stop", as OpenAI's and vLLM's do."""
    c = client(url)
    for i in range(8):
        for choice, names, end in (("required", {"get_weather", "get_time"}, "tool_calls"),
                                   ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, "stop")):
            kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                          max_tokens=300, temperature=1.0, seed=i)
            if not stream:
                resp = c.chat.completions.create(**kwargs)
                assert resp.choices[0].finish_reason == end, resp
                check_calls(resp.choices[0].message.tool_calls or [], names)
                continue
            chunks = list(c.chat.completions.create(stream=True, **kwargs))
            calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
            assert [tc.index for tc in calls] == list(range(len(calls)))
            check_calls(calls, names)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == end


def test_parallel_tool_calls_false_makes_one_call(url: str) -> None:
    resp = client(url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=3)
    assert len(resp.choices[0].message.tool_calls or []) == 1


def test_tool_choice_none_and_auto_on_a_model_that_makes_no_calls_answer_in_text(url: str) -> None:
    c = client(url)
    for choice in ("none", "auto"):
        resp = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=8,
                                         temperature=0)
        assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "length"


def test_a_stream_with_tools_carries_the_logprobs_the_whole_answer_has(url: str) -> None:
    """Tools make `auto` the default; a streamed answer in words still reports each token's
    logprobs (they go with the chunk that sends the token's text), as the whole one does."""
    c = client(url)
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0,
                                  logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None and whole.logprobs is not None and whole.logprobs.content
    chunks = list(c.chat.completions.create(stream=True, **kwargs))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs is not None
                for e in ch.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                     for e in whole.logprobs.content]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_them(url: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param  # type: ignore[index]


CALLED = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}


def test_a_conversation_with_earlier_tool_calls_is_served_and_a_misshaped_call_is_a_400(url: str) -> None:
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALLED]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    resp = client(url).chat.completions.create(model="tiny", messages=turn, tools=TOOLS, max_tokens=4,
                                               temperature=0)  # type: ignore[arg-type]
    assert resp.choices[0].finish_reason == "length"
    for bad in ({"id": "c"}, {"function": {"arguments": "{}"}}, {"function": "get_time"}, "call", None):
        wrong = [*ASK, {"role": "assistant", "tool_calls": [bad]}]
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="tiny", messages=wrong, max_tokens=4)  # type: ignore[arg-type]
        assert "messages" in str(e.value.body["param"]), e.value.body  # type: ignore[index]


def test_templates_get_earlier_calls_arguments_as_objects() -> None:
    from pdserve.cluster.protocol import ChatMessage

    m = ChatMessage.model_validate({"role": "assistant", "tool_calls": [CALLED]})
    (out,) = template_messages([m.template_dict("")])
    assert out["tool_calls"] == [{"id": "call_1", "type": "function",
                                  "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]


# -- the model's own formats ("auto") -----------------------------------------------------


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', None,
     [("get_time", {"zone": "UTC"})]),
    ('Let me look.\n<tool_call>{"name": "get_time", "arguments": {"zone": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>', "Let me look.\n",
     [("get_time", {"zone": "A"}), ("get_weather", {"city": "Oslo", "unit": "c"})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "B"}}]', None, [("get_time", {"zone": "B"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "C"}}', None, [("get_time", {"zone": "C"})]),
    ('{"name": "get_weather", "parameters": {"city": "X", "unit": "f"}}', None,
     [("get_weather", {"city": "X", "unit": "f"})]),
    # Llama 3.x's calls after one another, separated by ";" (vLLM's llama3_json parser reads them)
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "D"}}; {"name": "get_weather", "parameters": '
     '{"city": "Y; {", "unit": "c"}};', None,
     [("get_time", {"zone": "D"}), ("get_weather", {"city": "Y; {", "unit": "c"})]),
])
def test_the_families_formats_parse(text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> None:
    parsed = parse_calls(text, {"get_time", "get_weather"})
    assert parsed is not None
    got_content, got = parsed
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("text", ["The weather is fine.", '{"answer": 42}', '<tool_call>{"name": "rm_rf"}</tool_call>',
                                  "[TOOL_CALLS] not json",
                                  '{"name": "get_time", "parameters": {}}; and then some words',
                                  '{"name": "get_time", "parameters": {}}; {"answer": 42}',
                                  '{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}'])
def test_text_that_calls_no_known_tool_is_content(text: str) -> None:
    plan = ToolPlan.of(TOOLS, "auto", None)
    assert plan.parse(text) == (text, [])


class Scripted(FakeBackend):
    """Streams a fixed answer a few characters a delta (a model's own tool-call format)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, piece, [7], None, None,
                                                                            "stop" if last else None)], last)


HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "calls", "words"), [
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', 1, ""),
    ("Sunny, 21 degrees.", 0, "Sunny, 21 degrees."),
    ("Is a < b? Then [TOOL maybe.", 0, "Is a < b? Then [TOOL maybe."),  # marker-like words are words
    ("Let me check the time.\n" + HERMES_CALL, 1, "Let me check the time.\n"),  # Hermes after words
    ("<think>\nThe user wants the time.\n</think>\n\n" + HERMES_CALL, 1,  # Qwen3 thinks first
     "<think>\nThe user wants the time.\n</think>\n\n"),
    ('Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', 1, "Checking. "),  # Mistral
], ids=["call", "words", "marker-like-words", "words-then-hermes", "qwen3-think", "words-then-mistral"])
def test_auto_streams_words_as_they_come_and_calls_whole(make_model: Callable[[TinyModelSpec], Path], text: str,
                                                         calls: int, words: str) -> None:
    """Streamed, words go as they come, and a call after them still comes back as a call:
    what the whole (non-streamed) answer says, as vLLM's streaming parsers do."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2,
                                                             init_std=0.05)))
    gw = Gateway(Scripted(text), tok, GatewayConfig(model_name="tiny", max_model_len=1024))
    with serve_gateway(gw) as base:
        chunks = list(client(base).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True,
                                                           max_tokens=100))
        whole = client(base).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    got = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(got) == calls == len(whole.choices[0].message.tool_calls or [])
    content = [d.content for d in deltas if d.content]
    assert "".join(content) == words
    if words:
        assert len(content) > 1  # streamed, not held to the end
    if calls:
        assert got[0].function.name == "get_time" and json.loads(got[0].function.arguments) == {"zone": "UTC"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole.choices[0].finish_reason
        # The whole answer's content is what the stream sent, as it is (vLLM's: the text before the marker).
        assert whole.choices[0].message.content == (words if words.strip() else None)
    else:
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_sdks_stream_helper_gets_every_calls_done_event(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """OpenAI's SDK (`client.chat.completions.stream`) gives an agent each call's whole arguments
    (parsed too, for a strict tool) in a `tool_calls.function.arguments.done` event, fired when a
    later chunk names the next call or finishes; the calls, sent whole at the end, come before the
    finish in a chunk of their own (OpenAI's shape), or the last call would get no such event."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2,
                                                             init_std=0.05)))
    weather = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    for text in (HERMES_CALL, HERMES_CALL + "\n" + weather):
        gw = Gateway(Scripted(text), tok, GatewayConfig(model_name="tiny", max_model_len=1024))
        with serve_gateway(gw) as base, client(base).chat.completions.stream(
                model="tiny", messages=ASK, tools=TOOLS, max_tokens=100) as stream:
            events = list(stream)
            final = stream.get_final_completion()
        done = [(e.name, json.loads(e.arguments)) for e in events if e.type == "tool_calls.function.arguments.done"]
        expected = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "c"})]
        assert done == expected[:text.count("<tool_call>")]
        assert [c.function.name for c in final.choices[0].message.tool_calls or []] == [n for n, _ in done]
        assert final.choices[0].finish_reason == "tool_calls"


def test_required_calls_are_bounded_so_an_answer_ends() -> None:
    from pdserve.cluster.tool_calls import MAX_PARALLEL_CALLS

    schema = ToolPlan.of(TOOLS, "required", None).constraint()
    assert schema is not None and json.loads(schema.key()[1])["maxItems"] == MAX_PARALLEL_CALLS
    one = ToolPlan.of(TOOLS, "required", False).constraint()
    assert one is not None and json.loads(one.key()[1])["maxItems"] == 1
