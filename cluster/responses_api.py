"""OpenAI's Responses API (`POST /v1/responses`, what the Agents SDK and Codex CLI speak; vLLM
and SGLang serve it too), as a translation onto the chat path: the request becomes a chat
request (its `instructions` and `input` items the messages, its tools, text format and
reasoning effort chat's), runs as one, and the chat answer becomes Responses output items.

pdserve keeps no responses: `store` is accepted and answered `false` (vLLM without its store
does the same), `previous_response_id` is refused, GET of a response is a 404. Function tools
only: a built-in tool (web search, file search, ...) is refused naming its type.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdserve.cluster.api_errors import APIError, client_error
from pdserve.cluster.gateway import Gateway, Work
from pdserve.cluster.limits import RefusalReason, Refused
from pdserve.cluster.metrics import RequestMetrics
from pdserve.cluster.protocol import ChatChunkChoice, ChatCompletionRequest, ResponseBody, TokenLogprob, Usage, now
from pdserve.cluster.responses import (
    accumulate_delta,
    new_choices,
    parsed_chunk_choice,
    sse_event,
    token_names,
    usage_body,
    work_of,
)
from pdserve.workers.structured_outputs import StructuredOutputs

# What OpenAI's clients send that asks nothing pdserve must honour: accepted, not used.
IGNORED_FIELDS = frozenset({"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                            "include", "stream_options"})
# Chat's own fields beyond the Responses API's, passed to the chat request as they are (vLLM's
# ResponsesRequest takes its sampling extensions too).
CHAT_FIELDS = frozenset({"seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                         "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
                         "include_stop_str_in_output", "bad_words", "allowed_token_ids", "cache_salt", "speculative",
                         "chat_template_kwargs", "include_reasoning", "truncate_prompt_tokens",
                         "return_tokens_as_token_ids"})
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# The chat request's field names as a Responses request names them, for its errors.
_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
          "response_format.json_schema.schema": "text.format.schema", "response_format.json_schema": "text.format",
          "response_format": "text.format"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused by name (or passed to chat: CHAT_FIELDS)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field sent as null takes its default (as chat's: typed clients send nulls)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(..., description="a user message, or a list of items: messages, "
                                                               "function_call, function_call_output")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, description="the output text's logprobs, with this many top ones")
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(None, description='function tools: [{"type": "function", "name", '
                                                                 '"description", "parameters", "strict"}]')
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                                          '"json_schema", "name", "schema", "strict"}}')
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": ...}: the chat template\'s '
                                                               "reasoning_effort")
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = Field(None, description="accepted; pdserve keeps no responses (the response says false)")
    previous_response_id: str | None = Field(None, description="not supported: pdserve keeps no responses")
    background: bool | None = Field(None, description="not supported: only false")
    truncation: Literal["auto", "disabled"] | None = None

    def turns(self) -> list[int]:
        """Where the input's turns after its first begin: at each later user message. Truncation
        "auto" drops whole turns from the beginning, so a call and its output go together."""
        if isinstance(self.input, str):
            return []
        return [i for i, item in enumerate(self.input) if i > 0 and isinstance(item, dict)
                and item.get("type", "message") == "message" and item.get("role") == "user"]

    def chat_request(self, drop: int = 0) -> ResponsesChat:
        """The chat request this one asks for, less the input's first `drop` turns (`turns`); a
        ValueError names the field at fault."""
        if self.previous_response_id is not None:
            raise Refused("previous_response_id", "pdserve does not store responses: send the whole conversation "
                                                  "as input", RefusalReason.UNSUPPORTED)
        if self.background:
            raise Refused("background", "not supported: the response comes on its request",
                          RefusalReason.UNSUPPORTED)
        extra: dict[str, Any] = {}
        for name, value in sorted((self.model_extra or {}).items()):
            if name in CHAT_FIELDS:
                extra[name] = value
            elif name not in IGNORED_FIELDS:
                raise Refused(name, "pdserve does not support this field", RefusalReason.UNSUPPORTED)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": chat_messages(self.instructions, self.input[self.turns()[drop - 1]:] if drop else self.input),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "stream": self.stream, "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
            "reasoning_effort": (self.reasoning or {}).get("effort"), "user": self.user,
            "logprobs": self.top_logprobs is not None, "top_logprobs": self.top_logprobs, **extra}
        try:
            return ResponsesChat.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise ValueError(f"{_renamed(where) or 'body'}: {first.get('msg', 'invalid')}"[:500]) from None

    def text_format(self) -> dict[str, Any]:
        for key in sorted(set(self.text or {}) - {"format"}):  # `verbosity` among them, refused in chat too
            raise Refused(f"text.{key}"[:60], "pdserve does not support this field", RefusalReason.UNSUPPORTED)
        fmt = (self.text or {}).get("format", {"type": "text"})
        if not isinstance(fmt, dict):
            raise ValueError("text.format: must be an object with a type")
        return fmt

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format (None: free text)."""
        fmt = self.text_format()
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": spec}
        raise ValueError(f'text.format: type must be "text", "json_object" or "json_schema", got {str(kind)[:40]!r}')


class ResponsesChat(ChatCompletionRequest):
    """The chat request of a Responses request: its errors name the Responses fields."""

    def budget_field(self) -> str:
        return "max_output_tokens"

    def constraint(self) -> StructuredOutputs | None:
        try:
            return super().constraint()
        except ValueError as e:
            raise ValueError(_renamed(str(e))) from None


def _renamed(text: str) -> str:
    """`text` (an error, a field's path) with its leading chat field named as Responses names it
    (the whole name: "prompt_logprobs" stays)."""
    for chat, ours in _NAMES.items():
        rest = text.removeprefix(chat)
        if rest != text and (not rest or rest[0] in ".[: "):
            return ours + rest.replace(f"the {chat} ", f"the {ours} ", 1)
    return text


def responses_error(e: APIError) -> APIError:
    """A refusal on the chat path (the context's bound, a budget) with its field named as the
    Responses request names it: a client that sent `input` is told of `input`, not `prompt`."""
    e.message = _renamed(e.message)
    e.param = _renamed(e.param) if e.param else e.param
    return e


# -- the request: input items to chat messages ---------------------------------------


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of `instructions` (a system message first) and `input`. Consecutive
    function_call items (and one after an assistant message) make one assistant message's
    tool_calls, as a chat client sends them; reasoning items are dropped (vLLM's too)."""
    out: list[dict[str, Any]] = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not items:
        raise ValueError("input: must not be empty")
    for i, item in enumerate(items):
        kind = item.get("type", "message")  # an "easy" message has no type
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise ValueError(f"input: item {i}'s role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}")
            out.append({"role": role, "content": _content(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function",
                    "function": {"name": _string(i, item, "name"), "arguments": _string(i, item, "arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"),
                        "content": _content(i, item.get("output"))})
        elif kind != "reasoning":
            raise Refused("input", f"item {i}: type {str(kind)[:40]!r} is not supported (message, function_call, "
                                   "function_call_output, reasoning)", RefusalReason.UNSUPPORTED)
    return out


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"input: item {i} ({item.get('type')}) needs a string {key}")
    return value


def _content(i: int, content: object) -> str | list[dict[str, object]]:
    """A message's content (or a call's output): text, or text parts as chat's."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"input: item {i}'s content must be a string or a list of parts")
    parts: list[dict[str, object]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise Refused("input", f"item {i}: pdserve takes text parts only (input_text, output_text), got "
                                   f"type {str(kind)[:40]!r}", RefusalReason.UNSUPPORTED)
        parts.append({"type": "text", "text": part["text"]})
    return parts


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools (flat, as the Responses API writes them) as chat's."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise Refused("tools", f"tool {i}: type {str(tool.get('type'))[:40]!r}: pdserve serves function tools "
                                   "only (no built-in tools)", RefusalReason.UNSUPPORTED)
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # "none", "auto", "required" (chat checks it)
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise Refused("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      RefusalReason.UNSUPPORTED)
    return {"type": "function", "function": {"name": choice["name"]}}


# -- the response: output items -------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def message_item(item_id: str, text: str, logprobs: list[TokenLogprob], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)]}


def output_text(text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def call_item(item_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": _id("call"), "name": name, "arguments": arguments,
            "status": status}


def responses_usage(u: Usage) -> dict[str, Any]:
    # OpenAI's `cache_write_tokens` (required in its SDK's type) counts what a request paid to
    # write to a cache kept on purpose; pdserve's prefix cache keeps blocks as they are computed,
    # at no cost to anyone: none.
    details = {**u["prompt_tokens_details"], "cache_write_tokens": 0}
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": u.get("completion_tokens_details", {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": u["total_tokens"]}


def response_object(req: ResponsesRequest, rid: str, model: str, created: int, output: list[dict[str, Any]],
                    status: str = "in_progress", usage: Usage | None = None) -> dict[str, Any]:
    """The response object: its output and status, and the request's settings as OpenAI's repeats them."""
    tool_choice: object = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output, "usage": None if usage is None else responses_usage(usage),
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
        "tools": req.tools or [], "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {**(req.text or {}), "format": req.text_format()},
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": False, "previous_response_id": None, "background": False, "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {}, "user": req.user,
    }


def whole_response(req: ResponsesRequest, rid: str, body: ResponseBody) -> dict[str, Any]:
    """The response object of a chat request's whole response `body`."""
    choice = body["choices"][0]
    message = choice["message"]  # type: ignore[typeddict-item]  # a chat choice
    cut = choice["finish_reason"] == "length"
    output: list[dict[str, Any]] = []
    thinking = message.get("reasoning")
    if thinking:
        output.append(reasoning_item(_id("rs"), thinking))
    calls = message.get("tool_calls") or []
    if message["content"] or not (calls or output):
        logprobs = (choice["logprobs"] or {"content": []})["content"]  # type: ignore[typeddict-item]
        # Words before tool calls ended at the first call (a streamed message closes there): the
        # cut, if any, is in the calls.
        output.append(message_item(_id("msg"), message["content"] or "", logprobs,
                                   "incomplete" if cut and not calls else "completed"))
    output += [call_item(_id("fc"), c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return response_object(req, rid, body["model"], body["created"], output, "incomplete" if cut else "completed",
                            body["usage"])


# -- the stream -------------------------------------------------------------------------


@dataclass
class _Events:
    """The stream's SSE events, numbered as they go."""

    seq: int = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n{sse_event(body)}"


@dataclass
class _OutputStream:
    """The output items of a streamed answer as its chat deltas come: the thinking (a reasoning
    item), the text (a message item) and the tool calls (a function_call item each), each
    opened, added to and closed with its events. `items`: the ones closed."""

    ev: _Events
    items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the reasoning or message item being streamed
    text: str = ""  # the open item's so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the message's so far
    pending: list[TokenLogprob] = field(default_factory=list)  # of tokens whose text no text delta sent yet

    def chunk(self, c: ChatChunkChoice) -> list[str]:
        delta, out = c["delta"], []
        self.pending += (c.get("logprobs") or {"content": []})["content"]  # type: ignore[typeddict-item]
        if delta.get("reasoning"):
            out += self._add("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._add("message", delta["content"] or "")
        for call in delta.get("tool_calls") or ():
            out += self._close(False)
            item = call_item(_id("fc"), call["function"]["name"], "", "in_progress")
            args, at = call["function"]["arguments"], len(self.items)
            out += [self.ev("response.output_item.added", output_index=at, item=item),
                    self.ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                            delta=args),
                    self.ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                            arguments=args)]
            item = {**item, "arguments": args, "status": "completed"}
            self.items.append(item)
            out.append(self.ev("response.output_item.done", output_index=at, item=item))
        return out

    def finish(self, cut: bool) -> list[str]:
        """The events that close the stream's items (an answer of nothing: an empty message)."""
        out = [] if self.items or self.open else self._add("message", "")
        return out + self._close(cut)

    def _add(self, kind: str, piece: str) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == kind else self._close(False)
        at = len(self.items)
        if self.open is None:
            self.open = (message_item(_id("msg"), "", [], "in_progress") if kind == "message"
                         else {**reasoning_item(_id("rs"), ""), "content": [], "status": "in_progress"})
            part = output_text("", []) if kind == "message" else {"type": "reasoning_text", "text": ""}
            # The item as added holds no part yet (OpenAI's and vLLM's event): content_part.added adds it.
            out += [self.ev("response.output_item.added", output_index=at, item={**self.open, "content": []}),
                    self.ev("response.content_part.added", item_id=self.open["id"], output_index=at, content_index=0,
                            part=part)]
        self.text += piece
        where = {"item_id": self.open["id"], "output_index": at, "content_index": 0}
        if kind == "reasoning":
            return [*out, self.ev("response.reasoning_text.delta", **where, delta=piece)] if piece else out
        sent, self.pending = self.pending, []
        self.logprobs += sent
        return [*out, self.ev("response.output_text.delta", **where, delta=piece, logprobs=sent)] if piece else out

    def _close(self, cut: bool) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        text, self.text = self.text, ""
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            events = [self.ev("response.reasoning_text.done", **where, text=text),
                      self.ev("response.content_part.done", **where, part=done["content"][0])]
        else:
            self.logprobs += self.pending  # (tokens whose text was never sent: a stop string's)
            logprobs, self.logprobs, self.pending = self.logprobs, [], []
            done = message_item(item["id"], text, logprobs, "incomplete" if cut else "completed")
            events = [self.ev("response.output_text.done", **where, text=text, logprobs=logprobs),
                      self.ev("response.content_part.done", **where, part=done["content"][0])]
        self.items.append(done)
        return [*events, self.ev("response.output_item.done", output_index=where["output_index"], item=done)]


async def stream_responses(gw: Gateway, req: ResponsesRequest, rid: str, works: list[Work],
                           rm: RequestMetrics) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed response (no `[DONE]`: the Responses API's stream ends with
    its response.completed or response.incomplete, or an `error` event). The chat stream's
    parsing (thinking, tool calls) makes the deltas; every exit frees the request's work as
    chat's stream does."""
    ev, token_str, model, created = _Events(), token_names(gw, works), gw.config.model_name, now()
    choices, output = new_choices(works), _OutputStream(ev)
    rm.admitted(sum(len(w.prompt_ids) for w in works), [len(w.prompt_ids) for w in works])
    try:
        started = response_object(req, rid, model, created, [])
        yield ev("response.created", response=started)
        yield ev("response.in_progress", response=started)
        async with contextlib.aclosing(gw.run(rid, works)) as events:  # its request aborted now if cut short
            async for i, out in events:
                work = work_of(works, i)
                delta = accumulate_delta(choices[i], work, out, token_str)
                rm.output(out, i)
                chunk = parsed_chunk_choice(token_str, choices[i], work, delta)
                for event in output.chunk(chunk) if chunk is not None else ():
                    yield event
        rm.succeeded(c.finish_reason for c in choices)
        cut = choices[0].finish_reason == "length"
        for event in output.finish(cut):
            yield event
        status = "incomplete" if cut else "completed"
        yield ev(f"response.{status}", response=response_object(req, rid, model, created, output.items, status,
                                                                usage_body(works, choices)))
    except (asyncio.CancelledError, GeneratorExit):
        rm.failed(499)  # the client went away mid-stream
        raise
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = responses_error(client_error(e, rid))
        rm.failed(err.status)
        yield ev("error", code=err.err_type, message=err.message, param=err.param)
    finally:
        rm.close()
