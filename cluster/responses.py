"""OpenAI response assembly: a request's DELTA outputs become the choices, the
response body or the SSE chunks of /v1/completions and /v1/chat/completions.

The one place their wire shapes live. The two endpoints differ only in an
`ApiKind`'s `WireShape`: its object names, how a choice, a streamed delta and
logprobs look. Routes and HTTP wiring stay in openai_app.py; admission,
tokenization and the runs in gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from enum import Enum

from pydantic_core import PydanticSerializationError, to_json

from pdserve.cluster.api_errors import client_error
from pdserve.cluster.gateway import Gateway, Work
from pdserve.cluster.metrics import RequestMetrics
from pdserve.cluster.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    ChunkBody,
    Logprobs,
    ResponseBody,
    TextChoice,
    TextLogprobs,
    TokenLogprob,
    Usage,
    error_body,
    now,
    usage,
)
from pdserve.cluster.reasoning import END, ThinkingEnd, ThinkingStream
from pdserve.cluster.token_text import TokenIdText, TokenText
from pdserve.cluster.tool_calls import StreamedToolCall, ToolPlan
from pdserve.workers.outputs import RequestOutput

TokenStr = TokenText | TokenIdText  # a token's text (and `utf8`, its bytes)
# Per reported token, {token id: log-prob}; None for a prompt's first token (echo), which nothing predicts.
Entries = list[dict[int, float] | None]
DONE = "data: [DONE]\n\n"


@dataclass
class Choice:
    """One choice of a response as its deltas come in."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended it (None: EOS, length, or still running)
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    started: bool = False  # a chunk of it was streamed
    # With tools: its answer is streamed as content (True), or held back until it ends because
    # it is (or may be) a tool call, sent then as `tool_calls` (False).
    content: bool = False
    # Parsed (tools, reasoning): characters of the answer (`text` after its thinking) streamed as content
    sent: int = 0
    thinking: ThinkingStream = field(default_factory=ThinkingStream)  # with a reasoning parser: its split so far
    held: tuple[list[int], Entries] | None = None  # parsed: logprobs of tokens not yet streamed
    # Streamed with logprobs: characters of the tokens reported so far (the text_offset of the next:
    # as a whole response counts them, not the text sent, which a stop string can hold back)
    reported_chars: int = 0
    reasoning_tokens: int | None = None  # its tokens through the end of its thinking, once that has come


@dataclass(frozen=True)
class Delta:
    """What one output adds to its choice's stream."""

    index: int
    text: str
    finish_reason: str | None
    scored: tuple[list[int], Entries] | None  # (tokens, their logprob entries) when logprobs were asked for
    top_n: int = 0  # the top logprobs asked for a token (chat's `top_logprobs`)
    offset: int = 0  # completions' text_offset of this delta's first token
    stop_reason: int | str | None = None  # with `finish_reason`: the stop string or token id that ended it


class ApiKind(Enum):
    """Which endpoint a response is for: /v1/completions or /v1/chat/completions."""

    COMPLETION = "completion"
    CHAT = "chat"

    @property
    def shape(self) -> WireShape:
        return _SHAPES[self]


# -- the two wire formats ------------------------------------------------------


class WireShape(ABC):
    """Everything that differs between the completions and the chat format."""

    id_prefix: str
    object_name: str  # of a whole response
    chunk_object: str  # of a streamed chunk

    def opening(self, choices: list[Choice]) -> list[TextChoice | ChatChunkChoice] | None:
        """The choices of a chunk sent before any token, where the format has one."""
        return None

    @abstractmethod
    def choice(self, c: Choice, echo: str | None, logprobs: Logprobs | None) -> TextChoice | ChatChoice: ...

    @abstractmethod
    def delta(self, d: Delta, logprobs: Logprobs | None) -> TextChoice | ChatChunkChoice: ...

    @abstractmethod
    def logprobs(self, token_str: TokenStr, token_ids: list[int], entries: Entries, top_n: int,
                 offset: int = 0) -> Logprobs:
        """`entries`: the engine's, each the top `top_n` and the sampled token; `offset`: the
        characters of the choice's text before the first token."""


class _CompletionShape(WireShape):
    id_prefix = "cmpl"
    object_name = chunk_object = "text_completion"

    def choice(self, c: Choice, echo: str | None, logprobs: Logprobs | None) -> TextChoice:
        return {"index": c.index, "text": (echo or "") + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def delta(self, d: Delta, logprobs: Logprobs | None) -> TextChoice:
        out: TextChoice = {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:  # (only on a choice's last chunk: the others stay as short as they were)
            out["stop_reason"] = d.stop_reason
        return out

    def logprobs(self, token_str: TokenStr, token_ids: list[int], entries: Entries, top_n: int,
                 offset: int = 0) -> TextLogprobs:
        # The legacy shape keeps the sampled token among the top ones (vLLM's, and OpenAI's did).
        tokens = [token_str(t) for t in token_ids]
        offsets = []
        for tok in tokens:  # the lengths of the token strings before it (vLLM's; docs/api.md says where it differs)
            offsets.append(offset)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.get(t) for t, e in zip(token_ids, entries)],
            "top_logprobs": [None if e is None else {token_str(t): lp for t, lp in e.items()} for e in entries],
            "text_offset": offsets,
        }


class _ChatShape(WireShape):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, choices: list[Choice]) -> list[TextChoice | ChatChunkChoice] | None:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for c in choices]

    def choice(self, c: Choice, echo: str | None, logprobs: Logprobs | None) -> ChatChoice:
        message: AssistantMessage = {"role": "assistant", "content": c.text}
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def delta(self, d: Delta, logprobs: Logprobs | None) -> ChatChunkChoice:
        out: ChatChunkChoice = {"index": d.index, "delta": {"content": d.text}, "logprobs": logprobs,
                                "finish_reason": d.finish_reason}
        if d.finish_reason is not None:  # (only on a choice's last chunk: the others stay as short as they were)
            out["stop_reason"] = d.stop_reason
        return out

    def logprobs(self, token_str: TokenStr, token_ids: list[int], entries: Entries, top_n: int,
                 offset: int = 0) -> ChatLogprobs:
        content: list[TokenLogprob] = []
        for tok, entry in zip(token_ids, entries):
            scores = entry or {}  # never None: a chat request does not echo its prompt
            # Exactly `top_logprobs` of them (none by default), as OpenAI and vLLM answer: the
            # engine's entry adds the sampled token when it is not among them.
            top = sorted(scores.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": token_str(tok), "logprob": scores.get(tok, 0.0), "bytes": token_str.utf8(tok),
                            "top_logprobs": [{"token": token_str(t), "logprob": lp, "bytes": token_str.utf8(t)}
                                             for t, lp in top]})
        return {"content": content}


_SHAPES: dict[ApiKind, WireShape] = {ApiKind.COMPLETION: _CompletionShape(), ApiKind.CHAT: _ChatShape()}


# -- accumulation ----------------------------------------------------------------


def new_choices(works: list[Work]) -> list[Choice]:
    """Prompt p's sample j is choice p * n + j."""
    return [Choice(i) for i in range(sum(w.params.n for w in works))]


def work_of(works: list[Work], index: int) -> Work:
    return works[index // works[0].params.n]


def accumulate(choice: Choice, out: RequestOutput, prompt_only: bool = False) -> None:
    c = out.outputs[0]
    if out.prompt_logprobs is not None:  # over the token stream they may come in slices
        choice.prompt_logprobs = (choice.prompt_logprobs or []) + out.prompt_logprobs
    if not prompt_only:
        choice.text += c.text
        choice.token_ids += c.token_ids
        choice.logprobs += c.logprobs or []
    # echo with max_tokens 0: the one token generated is dropped, whatever ended it.
    finish = "length" if prompt_only and c.finish_reason is not None else c.finish_reason
    choice.finish_reason = finish or choice.finish_reason
    if c.finish_reason is not None and not prompt_only:
        choice.stop_reason = c.stop_reason
    choice.cached_tokens = out.num_cached_tokens


def accumulate_delta(choice: Choice, work: Work, out: RequestOutput, token_str: TokenStr) -> Delta:
    """`accumulate`, and what `out` adds to the stream: with echo, the prompt goes
    before the choice's first text, and its logprobs before the tokens' as they come."""
    c = out.outputs[0]
    head, choice.started = not choice.started, True
    already = len(choice.prompt_logprobs or [])  # prompt tokens an earlier chunk reported
    accumulate(choice, out, work.prompt_only)
    text = "" if work.prompt_only else c.text
    ids: list[int] = [] if work.prompt_only else c.token_ids
    entries: Entries = [] if work.prompt_only else list(c.logprobs or [])
    if head:
        text = (work.echo or "") + text
    if work.params.prompt_logprobs is not None and out.prompt_logprobs:
        new = out.prompt_logprobs
        ids, entries = work.prompt_ids[already : already + len(new)] + ids, list(new) + entries
    finish = choice.finish_reason if c.finish_reason is not None else None
    stop = choice.stop_reason if finish is not None else None
    if work.params.logprobs is None:
        return Delta(choice.index, text, finish, None, stop_reason=stop)
    offset = choice.reported_chars
    choice.reported_chars += sum(len(token_str(t)) for t in ids)
    return Delta(choice.index, text, finish, (ids, entries), work.params.logprobs, offset, stop)


# -- rendering -------------------------------------------------------------------


def _reported(work: Work, c: Choice) -> tuple[list[int], Entries]:
    """The tokens and logprob entries a whole response reports: with echo + logprobs, the prompt's first."""
    if work.params.prompt_logprobs is None:
        return c.token_ids, list(c.logprobs)
    prompt = c.prompt_logprobs or [None] * len(work.prompt_ids)
    return work.prompt_ids + c.token_ids, prompt + list(c.logprobs)


def final_choice(kind: ApiKind, token_str: TokenStr, c: Choice, work: Work) -> TextChoice | ChatChoice:
    shape = kind.shape
    logprobs = shape.logprobs(token_str, *_reported(work, c), work.params.logprobs or 0) \
        if work.params.logprobs is not None else None
    if work.reasoning is None and (work.tools is None or not work.tools.active):
        return shape.choice(c, work.echo, logprobs)
    # A parsed chat answer: its thinking first (with a reasoning parser), then tool calls in the rest.
    thinking, content = (None, c.text) if work.reasoning is None else work.reasoning.split(c.text)
    message: AssistantMessage = {"role": "assistant", "content": content}
    finish = c.finish_reason
    if work.tools is not None and work.tools.active and content is not None:
        words, calls = work.tools.parse(content)
        if calls:
            message = {"role": "assistant", "content": words, "tool_calls": calls}
            finish = _calls_finish(work.tools, finish)
    if work.reasoning is not None and work.reasoning.include:
        message["reasoning"] = message["reasoning_content"] = thinking
    return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": c.stop_reason}


def _calls_finish(plan: ToolPlan, reason: str | None) -> str | None:
    """An answer that ends in tool calls the model chose to make ("auto", "required") finishes
    with "tool_calls" (OpenAI's), not "stop". A call to a named function, which the request
    forced, finishes with "stop": OpenAI's and vLLM's answer to `tool_choice: {"function": ...}`."""
    return "tool_calls" if reason == "stop" and plan.mode != "named" else reason


def parsed_chunk_choice(token_str: TokenStr, choice: Choice, work: Work, d: Delta) -> ChatChunkChoice | None:
    """What a chat stream whose answers are parsed (for their thinking, for tool calls) sends for
    delta `d` of `choice`: the thinking as it comes (held where a tag may be coming: the tags
    never reach the client), then the answer after it, as plain content or as `_tool_delta`
    says. Logprobs go with the chunk that sends their tokens' text, or with the last. None:
    nothing to send yet."""
    if d.scored is not None:
        ids, entries = choice.held or ([], [])
        choice.held = (ids + d.scored[0], entries + list(d.scored[1]))
    done = d.finish_reason is not None
    delta: ChatDelta = {}
    start: int | None = 0  # where the answer after the thinking starts in the text (None: not yet)
    if work.reasoning is not None:
        piece, start = choice.thinking.advance(choice.text, done)
        if piece and work.reasoning.include:
            delta["reasoning"] = delta["reasoning_content"] = piece
    finish = d.finish_reason
    if work.tools is not None and work.tools.active:
        # The answer is the text from `start` (none yet while thinking), passed by offset: a copy
        # of it a token would cost the stream the answer's length each token.
        base = len(choice.text) if start is None else start
        words, finish = _tool_delta(work.tools, choice, choice.text, base, d.finish_reason)
        delta.update(words)
    elif start is not None and len(choice.text) > start + choice.sent:
        # (by offsets: a copy of the answer a token would cost the stream its length each token)
        delta["content"], choice.sent = choice.text[start + choice.sent :], len(choice.text) - start
    if not delta:
        if not done:
            return None
        delta["content"] = ""  # the last chunk, with the finish reason
    return _tool_chunk(token_str, choice, d, delta, finish)


def finish_apart(chunk: ChatChunkChoice) -> list[ChatChunkChoice]:
    """A chunk that carries tool calls and the finish reason, sent as two, as OpenAI's stream
    sends them: the calls, then the finish with an empty delta. OpenAI's SDK fires a call's
    `tool_calls.function.arguments.done` (its whole arguments) when a later chunk names
    another call or finishes; it reads the finish before the calls of the same chunk, so the
    last call of a chunk that held both never got its event."""
    if chunk["finish_reason"] is None or not chunk["delta"].get("tool_calls"):
        return [chunk]
    calls: ChatChunkChoice = {**chunk, "finish_reason": None}
    calls.pop("stop_reason", None)
    end: ChatChunkChoice = {"index": chunk["index"], "delta": {}, "logprobs": None,
                            "finish_reason": chunk["finish_reason"], "stop_reason": chunk.get("stop_reason")}
    return [calls, end]


def _tool_delta(plan: ToolPlan, choice: Choice, text: str, base: int,
                finish_reason: str | None) -> tuple[ChatDelta, str | None]:
    """What a chat stream with tools sends of its answer so far, `text[base:]` (`choice.sent`
    counts from `base`), and the finish reason. An answer that is (or may still be) a tool call:
    nothing until it ends, then the calls (or, if it was no call after all, its text as content).
    An "auto" answer in words: its content as it comes, up to a call marker that may follow words
    (Hermes, Mistral: tool_calls.INLINE_MARKERS); from there on it is held, as a call, to its end."""
    if not choice.content and plan.mode == "auto" and not plan.may_be_call(text[base:]):
        choice.content = True  # an answer in words: the held text goes now, the rest as it comes
    end = max(choice.sent, plan.words_end(text, base + choice.sent) - base) if choice.content else 0
    if finish_reason is None:
        if not choice.content:
            return {}, None
        piece, choice.sent = text[base + choice.sent : base + end], end
        return ({"content": piece} if piece else {}), None
    content, calls = plan.parse(text[base:])
    if not calls:
        return {"content": text[base + choice.sent :]}, finish_reason
    streamed: list[StreamedToolCall] = [{"index": i, **c} for i, c in enumerate(calls)]
    # The parse's content, less what the stream sent of it (the words before the first marker it
    # met; the call may begin at a later one: with every format parsed, `<tool_call>` wins over a
    # `[TOOL_CALLS]` before it, which then is words).
    words = (content or "")[choice.sent:] if choice.content else content
    return {"content": words or None, "tool_calls": streamed}, _calls_finish(plan, finish_reason)


def _tool_chunk(token_str: TokenStr, choice: Choice, d: Delta, delta: ChatDelta,
                finish_reason: str | None = None) -> ChatChunkChoice:
    """One chunk of a parsed stream, with the logprobs of the tokens held so far."""
    logprobs = None
    if choice.held is not None:
        logprobs, choice.held = _SHAPES[ApiKind.CHAT].logprobs(token_str, *choice.held, d.top_n), None
    out: ChatChunkChoice = {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        out["stop_reason"] = choice.stop_reason
    return out


def usage_body(works: list[Work], choices: list[Choice]) -> Usage:
    n = works[0].params.n
    u = usage(sum(len(w.prompt_ids) for w in works), sum(len(c.token_ids) for c in choices),
              sum(choices[p * n].cached_tokens for p in range(len(works))))
    plan = works[0].reasoning
    if plan is not None and plan.end is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": sum(_reasoning_tokens(plan.end, c) for c in choices)}
    return u


def _reasoning_tokens(end: ThinkingEnd, c: Choice) -> int:
    """`c`'s reasoning tokens so far; once its thinking has ended, kept (continuous usage asks
    again at every chunk)."""
    if c.reasoning_tokens is None:
        if END not in c.text:
            return len(c.token_ids)  # all thinking so far
        c.reasoning_tokens = end.tokens(c.token_ids, c.text)
    return c.reasoning_tokens


def token_names(gw: Gateway, works: list[Work]) -> TokenStr:
    """How the request's logprobs name tokens: by their text, or `token_id:<id>` when it asked."""
    return _TOKEN_IDS if works[0].tokens_as_ids else gw.token_str


_TOKEN_IDS = TokenIdText()


def response_body(gw: Gateway, kind: ApiKind, rid: str, works: list[Work], choices: list[Choice]) -> ResponseBody:
    token_str = token_names(gw, works)
    return {
        "id": rid, "object": kind.shape.object_name, "created": now(), "model": gw.config.model_name,
        "choices": [final_choice(kind, token_str, c, work_of(works, c.index)) for c in choices],
        "usage": usage_body(works, choices),
    }


def sse_event(body: Mapping[str, object]) -> str:
    return f"data: {json_text(body)}\n\n"


def json_text(body: Mapping[str, object]) -> str:
    """A body of model output as JSON text, whatever the model wrote. pydantic-core's serializer
    (FastAPI's own dependency) writes a chunk in under a microsecond, the standard library's
    json.dumps in ~7: one chunk per token of every stream. Infinities as json.dumps writes them
    (a logprob may be -inf); a lone surrogate (a tool call's arguments may carry "\\ud800", which
    UTF-8 cannot) escaped, as json.dumps escapes it, not a failed response."""
    try:
        return to_json(body, inf_nan_mode="constants").decode()
    except PydanticSerializationError:  # what json.dumps escapes and it refuses (a lone surrogate)
        return json.dumps(body)


@dataclass(frozen=True)
class ChunkRenderer:
    """The chunks of one stream: each carries the stream's id, object name, creation time and model."""

    kind: ApiKind
    rid: str
    model: str
    token_str: TokenStr
    created: int = field(default_factory=now)

    def chunk(self, choices: list[TextChoice | ChatChunkChoice], usage: Usage | None = None) -> str:
        body: ChunkBody = {"id": self.rid, "object": self.kind.shape.chunk_object, "created": self.created,
                           "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return sse_event(body)

    def opening(self, choices: list[Choice], usage: Usage | None = None) -> str | None:
        opening = self.kind.shape.opening(choices)
        return None if opening is None else self.chunk(opening, usage)

    def delta(self, d: Delta, usage: Usage | None = None) -> str:
        shape = self.kind.shape
        logprobs = None if d.scored is None else shape.logprobs(self.token_str, *d.scored, d.top_n, d.offset)
        return self.chunk([shape.delta(d, logprobs)], usage)


# -- a request's outputs to its response -------------------------------------------


def _prompt_tokens(works: list[Work]) -> int:
    return sum(len(w.prompt_ids) for w in works)


def _choice_prompts(works: list[Work]) -> list[int]:
    """Each choice's prompt length, by choice index (prompt p's sample j is choice p * n + j)."""
    return [len(w.prompt_ids) for w in works for _ in range(w.params.n)]


async def collect_response(gw: Gateway, kind: ApiKind, rid: str, works: list[Work],
                           rm: RequestMetrics) -> ResponseBody:
    """The whole response body; a failure raises an APIError (its handler counts it)."""
    choices = new_choices(works)
    rm.admitted(_prompt_tokens(works), _choice_prompts(works))
    try:
        async with contextlib.aclosing(gw.run(rid, works)) as events:  # its request aborted now if cut short
            async for i, out in events:
                prompt_only = work_of(works, i).prompt_only
                rm.output(out, i, prompt_only)  # the client gets it with the body; timed as a stream would be
                accumulate(choices[i], out, prompt_only)
        rm.succeeded(c.finish_reason for c in choices)
    except Exception as e:  # noqa: BLE001 - an OpenAI error object, and a status the metrics can count
        raise client_error(e, rid) from None  # what the client may see; client_error logged the rest
    finally:
        rm.close()  # a failure is counted by the APIError handler
    return response_body(gw, kind, rid, works, choices)


async def stream_response(gw: Gateway, kind: ApiKind, rid: str, works: list[Work], include_usage: bool,
                          rm: RequestMetrics, continuous_usage: bool = False) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed response, `[DONE]` last. The status line is
    sent by then, so a failure is an in-band error event, counted here.
    `continuous_usage`: every chunk carries the usage so far (vLLM's
    `stream_options.continuous_usage_stats`)."""
    render = ChunkRenderer(kind, rid, gw.config.model_name, token_names(gw, works))
    choices = new_choices(works)
    rm.admitted(_prompt_tokens(works), _choice_prompts(works))

    def so_far() -> Usage | None:
        return usage_body(works, choices) if continuous_usage else None

    try:
        opening = render.opening(choices, so_far())
        if opening is not None:
            yield opening
        # Closed here, however the stream ends: a request whose client is gone is aborted
        # on its workers now, not when the event loop finalizes the abandoned generator.
        async with contextlib.aclosing(gw.run(rid, works)) as events:
            async for i, out in events:
                work = work_of(works, i)
                delta = accumulate_delta(choices[i], work, out, render.token_str)
                rm.output(out, i, work.prompt_only)
                if work.reasoning is not None or (work.tools is not None and work.tools.active):
                    chunk = parsed_chunk_choice(render.token_str, choices[i], work, delta)
                    for part in finish_apart(chunk) if chunk is not None else ():
                        yield render.chunk([part], so_far())
                    continue
                yield render.delta(delta, so_far())
        rm.succeeded(c.finish_reason for c in choices)
        if include_usage:
            yield render.chunk([], usage=usage_body(works, choices))
    except (asyncio.CancelledError, GeneratorExit):
        rm.failed(499)  # the client went away mid-stream (after success it is already closed)
        raise
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = client_error(e, rid)
        rm.failed(err.status)
        yield sse_event(error_body(err.message, err.err_type, err.status, err.param))
    finally:
        rm.close()
    yield DONE
