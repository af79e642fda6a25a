"""OpenAI's Responses API (`POST /v1/responses`), served as the chat request it amounts to: the
same greedy text, usage, prompts, tool calls and constrained output as /v1/chat/completions,
in the Responses API's objects and stream events, which the openai package (the contract's
oracle) parses as its typed objects."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from factories import FakeBackend, serve_gateway, sse_events, tiny_engine_url, tiny_spec
from openai.types import responses as rt

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

TOOL = {"type": "function", "name": "get_time", "description": "the time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def events(text: str) -> list[dict[str, Any]]:
    """A Responses stream's events: each `event:` line names the `data:` line's type."""
    out, kind = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            body = json.loads(line[6:])
            assert body["type"] == kind, (kind, body)
            out.append(body)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


# -- the tiny model, served --------------------------------------------------------------


@pytest.fixture(scope="module")
def url(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[str]:
    with tiny_engine_url(make_model(tiny_spec(init_std=0.05)), max_model_len=256) as base:
        yield base


def test_greedy_text_and_usage_are_chats_whole_and_streamed(url: str) -> None:
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 6, "temperature": 0})
    want = chat.json()["choices"][0]
    body = {"instructions": "Be brief.", "input": "hi", "max_output_tokens": 6, "temperature": 0}
    as_items = {**body, "input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                   "text": "hi"}]}]}
    for req in (body, as_items):
        got = httpx.post(f"{url}/v1/responses", json=req, timeout=60)
        assert got.status_code == 200, got.text
        r = got.json()
        assert r["id"].startswith("resp_") and r["object"] == "response" and r["store"] is False
        [item] = r["output"]
        assert item["type"] == "message" and item["content"][0]["text"] == want["message"]["content"]
        u, cu = r["usage"], chat.json()["usage"]
        assert (u["input_tokens"], u["output_tokens"], u["total_tokens"]) == (
            cu["prompt_tokens"], cu["completion_tokens"], cu["total_tokens"])
        cut = want["finish_reason"] == "length"
        assert r["status"] == ("incomplete" if cut else "completed")
        assert r["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)

    streamed = httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200 and "[DONE]" not in streamed.text
    evs = events(streamed.text)
    kinds = [e["type"] for e in evs]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    added = evs[2]["item"]  # no part yet, as OpenAI's event has it: content_part.added brings it
    assert (added["type"], added["status"], added["content"]) == ("message", "in_progress", [])
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if cut else "response.completed"]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == want["message"]["content"] == evs[-1]["response"]["output"][0]["content"][0]["text"]
    assert evs[-1]["response"]["usage"] == r["usage"]


def test_max_output_tokens_cut_is_incomplete(url: str) -> None:
    r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 1, "ignore_eos": True},
                   timeout=60).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 1


def test_json_schema_format_constrains_as_chats_response_format(url: str) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "input": "who?", "max_output_tokens": 200, "temperature": 0.9, "seed": 4, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    text = r.json()["output"][0]["content"][0]["text"]
    jsonschema.validate(json.loads(text), PERSON)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "who?"}], "max_tokens": 200, "temperature": 0.9, "seed": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert text == chat.json()["choices"][0]["message"]["content"]
    assert r.json()["text"]["format"] == fmt


def test_the_openai_sdk_parses_the_response_and_its_stream(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, top_logprobs=2)
    assert isinstance(r, rt.Response) and isinstance(r.output[0], rt.ResponseOutputMessage)
    part = r.output[0].content[0]
    assert isinstance(part, rt.ResponseOutputText) and r.output_text == part.text
    assert part.logprobs is not None and len(part.logprobs) == r.usage.output_tokens  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    stream = list(client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0,
                                          stream=True))
    assert isinstance(stream[0], rt.ResponseCreatedEvent) and isinstance(stream[1], rt.ResponseInProgressEvent)
    assert isinstance(stream[-1], (rt.ResponseCompletedEvent, rt.ResponseIncompleteEvent))
    assert "".join(e.delta for e in stream if isinstance(e, rt.ResponseTextDeltaEvent)) == r.output_text
    assert stream[-1].response.output_text == r.output_text
    # The SDK builds its objects without checking them: checked here against its own types (a
    # required field missing comes back as None where its type promises an int).
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0}
    rt.Response.model_validate(httpx.post(f"{url}/v1/responses", json=body, timeout=60).json())
    events = pydantic.TypeAdapter(rt.ResponseStreamEvent)
    for event in sse_events(httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60).text):
        events.validate_python(event)


BAD = [
    ({"model": "tiny"}, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),  # as chat's `verbosity`
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    # Over the context: refused on the chat path, where the prompt is "prompt" or "messages".
    ({"input": "word " * 400}, "input"),
    ({"input": "x" * 100_000}, "input"),
    ({"input": [{"role": "user", "content": "word " * 400}]}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field_and_the_next_request_is_served(url: str, body: dict[str, Any],
                                                                           param: str) -> None:
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, err
    assert not err["message"].startswith(("prompt", "messages", "max_tokens", "max_completion_tokens")), err
    ok = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_a_schema_that_dead_ends_is_a_400_naming_text_format_whole_and_streamed(url: str) -> None:
    # It compiles, and after "ab" nothing can follow: the worker refuses the request mid-answer,
    # naming the chat field its grammar came from; the client sent `text.format`.
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "^ab[^\\s\\S]$"}}
    body = {"model": "tiny", "input": "x", "max_output_tokens": 10, "text": {"format": fmt}}
    whole = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "text.format.schema", whole.text
    assert "response_format" not in whole.json()["error"]["message"]
    last = events(httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60).text)[-1]
    assert last["type"] == "error" and last["param"] == "text.format.schema", last
    assert "response_format" not in last["message"]


def test_stored_responses_are_not_found(url: str) -> None:
    r = httpx.get(f"{url}/v1/responses/resp_1", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert "does not store responses" in r.json()["error"]["message"]


# -- a scripted model: tool calls, prompts, thinking --------------------------------------

# Renders what the tool-call path depends on: the tools, an assistant's calls, a tool's answer.
TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }} "
            "{{ c.function.arguments | tojson }}</call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Scripted(FakeBackend):
    """Answers `text`'s tokens, one a delta; remembers the prompts."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.text, self.prompts = tokenizer, "", []  # type: list[list[int]]
        self.fail_after: int | None = None  # tokens, then a worker's error
        self.finish = "stop"  # the last token's finish reason ("length": cut by max_output_tokens)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        for k, t in enumerate(ids):
            if k == self.fail_after:
                raise RuntimeError("the worker fell over")
            last = k == len(ids) - 1
            entries = [{t: -0.5}] if params.logprobs is not None else None
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, self.tokenizer.decode([t]), [t], None, entries, self.finish if last else None)], last)


@pytest.fixture(scope="module")
def scripted(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[tuple[str, Scripted]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_model(tiny_spec()))
    tok.chat_template = TEMPLATE
    backend = Scripted(tok)
    gw = Gateway(backend, tok, GatewayConfig(model_name="tiny", max_model_len=1024,  # type: ignore[arg-type]
                                             reasoning_parser="deepseek_r1"))
    with serve_gateway(gw) as base:
        yield base, backend
    assert gw.admitted == 0  # every response released its admission slot


def test_an_error_mid_stream_is_an_error_event_that_ends_it(scripted: tuple[str, Scripted]) -> None:
    base, backend = scripted
    backend.text, backend.fail_after = "</think>It is noon.", 2
    try:
        evs = events(httpx.post(f"{base}/v1/responses", json={"input": "time?", "stream": True}, timeout=60).text)
        whole = httpx.post(f"{base}/v1/responses", json={"input": "time?"}, timeout=60)
    finally:
        backend.fail_after = None
    assert evs[-1]["type"] == "error" and evs[-1]["code"] == "InternalServerError", evs[-1]
    assert "the worker fell over" not in evs[-1]["message"]  # a worker's error stays in the log
    assert not any(e["type"].startswith("response.completed") for e in evs)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "InternalServerError"
    assert httpx.post(f"{base}/v1/responses", json={"input": "time?"}, timeout=60).status_code == 200


def test_a_tool_call_is_a_function_call_item_whole_and_streamed(scripted: tuple[str, Scripted]) -> None:
    base, backend = scripted
    backend.text = f"</think>{CALL}"
    req = {"input": "what time is it?", "tools": [TOOL]}
    r = httpx.post(f"{base}/v1/responses", json=req, timeout=60).json()
    assert r["status"] == "completed" and [i["type"] for i in r["output"]] == ["function_call"], r
    call = r["output"][0]
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_time", {"zone": "UTC"}, "completed")
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")

    evs = events(httpx.post(f"{base}/v1/responses", json={**req, "stream": True}, timeout=60).text)
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert json.loads(evs[4]["arguments"]) == {"zone": "UTC"} and evs[-1]["response"]["output"] == [evs[5]["item"]]

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    typed = client.responses.create(model="tiny", input="what time is it?", tools=[TOOL])  # type: ignore[list-item]
    assert isinstance(typed.output[0], rt.ResponseFunctionToolCall) and typed.output[0].name == "get_time"
    kinds = {type(e) for e in client.responses.create(model="tiny", input="what time?", tools=[TOOL],  # type: ignore[list-item]
                                                      stream=True)}
    assert {rt.ResponseFunctionCallArgumentsDeltaEvent, rt.ResponseFunctionCallArgumentsDoneEvent} <= kinds


def test_words_then_a_call_cut_short_give_the_same_items_whole_and_streamed(scripted: tuple[str, Scripted]) -> None:
    """Cut by max_output_tokens inside a call after words: the response is incomplete either way,
    and its message item (the words, which ended where the call began) is completed either way.
    The whole response marked that message incomplete, the stream completed."""
    base, backend = scripted
    backend.text, backend.finish = "</think>Checking. " + CALL.removesuffix("</tool_call>"), "length"
    req = {"input": "what time is it?", "tools": [TOOL]}
    try:
        whole = httpx.post(f"{base}/v1/responses", json=req, timeout=60).json()
        evs = events(httpx.post(f"{base}/v1/responses", json={**req, "stream": True}, timeout=60).text)
    finally:
        backend.finish = "stop"
    streamed = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete" and whole["status"] == streamed["status"] == "incomplete"
    shape = [[(i["type"], i["status"]) for i in r["output"]] for r in (whole, streamed)]
    assert shape[0] == shape[1] == [("message", "completed"), ("function_call", "completed")], shape


def test_function_call_items_build_the_prompt_chat_builds(scripted: tuple[str, Scripted]) -> None:
    base, backend = scripted
    backend.text = "</think>It is noon."
    args = '{"zone": "UTC"}'
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={"tools": [{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}], "messages": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": args}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]})
    assert chat.status_code == 200, chat.text
    r = httpx.post(f"{base}/v1/responses", timeout=60, json={"instructions": "Use tools.", "tools": [TOOL], "input": [
        {"role": "user", "content": "time?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": args},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}]})
    assert r.status_code == 200, r.text
    assert backend.prompts[-1] == backend.prompts[-2]
    assert "<call call_2>get_time" in backend.tokenizer.decode(backend.prompts[-1])
    assert r.json()["output"][0]["content"][0]["text"] == "It is noon."


def test_thinking_is_a_reasoning_item_whole_and_streamed(scripted: tuple[str, Scripted]) -> None:
    base, backend = scripted
    backend.text = "Noon, says the clock.</think>It is noon."
    r = httpx.post(f"{base}/v1/responses", json={"input": "time?", "reasoning": {"effort": "low"}}, timeout=60).json()
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "Noon, says the clock."}]
    assert r["output"][1]["content"][0]["text"] == "It is noon."

    evs = events(httpx.post(f"{base}/v1/responses", json={"input": "time?", "stream": True}, timeout=60).text)
    thinking = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert (thinking, text) == ("Noon, says the clock.", "It is noon.")
    assert [i["type"] for i in evs[-1]["response"]["output"]] == ["reasoning", "message"]
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1]
    stream = list(openai.OpenAI(base_url=f"{base}/v1", api_key="none").responses.create(
        model="tiny", input="time?", stream=True))
    assert any(isinstance(e, rt.ResponseReasoningTextDeltaEvent) for e in stream)
    assert isinstance(stream[-1], rt.ResponseCompletedEvent) and stream[-1].response.output_text == "It is noon."


def test_truncation_auto_drops_the_earliest_turns_until_the_input_fits(url: str) -> None:
    """OpenAI's truncation "auto": an input over the context drops items from its beginning (whole
    turns here: from one user message to the next, so a call and its output go together) until
    it fits; `instructions` stay. The oracle: chat with the turns kept. "disabled" (the
    default) is a 400, as is an input whose last turn alone does not fit."""
    long = "word " * 300  # over the 256-token context alone
    call = [{"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": long}]
    turns = [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "what time is it?"}, *call,
             {"role": "user", "content": "and now?"}, {"role": "assistant", "content": "noon"},
             {"role": "user", "content": "thanks"}]
    body = {"instructions": "Be brief.", "input": turns, "max_output_tokens": 4, "temperature": 0,
            "tools": [TOOL], "truncation": "auto"}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    kept = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and now?"},
            {"role": "assistant", "content": "noon"}, {"role": "user", "content": "thanks"}]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": kept, "max_tokens": 4, "temperature": 0,
        "tools": [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]})
    assert chat.status_code == 200, chat.text
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert r.json()["output"][-1]["content"][0]["text"] == chat.json()["choices"][0]["message"]["content"]
    assert r.json()["truncation"] == "auto"
    streamed = events(httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=60).text)
    got, want = streamed[-1]["response"]["usage"], r.json()["usage"]  # (the second hits the prefix cache)
    assert (got["input_tokens"], got["output_tokens"]) == (want["input_tokens"], want["output_tokens"])

    for refused in ({**body, "truncation": "disabled"}, {**body, "input": [*turns[:-1], {"role": "user",
                                                                                         "content": long}]},
                    {**body, "input": long}):
        r = httpx.post(f"{url}/v1/responses", json=refused, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_truncations_tries_leave_no_admission_slot_held(scripted: tuple[str, Scripted]) -> None:
    """Each try of the search holds a slot while it tokenizes: the ones not taken, and all of
    them when nothing fits, are released (the fixture checks none is held at its end)."""
    base, backend = scripted
    backend.text = "It is noon."
    long = "word " * 1200  # over the 1024-token context alone
    turns = [item for k in range(6) for item in ({"role": "user", "content": long if k < 4 else f"q{k}"},
                                                 {"role": "assistant", "content": "ok"})]
    ok = httpx.post(f"{base}/v1/responses", json={"input": [*turns, {"role": "user", "content": "now?"}],
                                                  "truncation": "auto"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert backend.prompts[-1] == backend.tokenizer.encode(  # the turns from the first short one on
        backend.tokenizer.apply_chat_template([*turns[8:], {"role": "user", "content": "now?"}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    no = httpx.post(f"{base}/v1/responses", json={"input": [*turns, {"role": "user", "content": long}],
                                                  "truncation": "auto"}, timeout=60)
    assert no.status_code == 400 and no.json()["error"]["param"] == "input"
