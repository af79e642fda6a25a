"""OpenAI-compatible request and response shapes (the subset pdserve serves).

Requests are pydantic models so FastAPI validates them and /openapi.json
describes them. A field pdserve does not honour is refused with a 400 naming
it (vLLM logs and ignores unknown fields; a client asking for JSON output or
tool calls would then get free text with a 200): the OpenAI options it cannot
do are modelled so the refusal is explicit, any other unknown field is
refused too, except the few in `IGNORED_FIELDS` that change nothing.

Response bodies and stream chunks are TypedDicts: responses.py builds them as
plain dicts (a chunk per token: no model to validate on the way out).
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.cluster.limits import RefusalReason, Refused, RequestLimits, check_count, check_n, check_stop
from pdserve.cluster.tool_calls import StreamedToolCall, ToolCall, ToolPlan
from pdserve.workers.generation_defaults import pick
from pdserve.workers.inputs import check_template_kwargs
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.structured_outputs import StructuredOutputs

# Fields OpenAI clients may send that ask nothing of the model: accepted, not used.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier",
                            # what OpenAI's clients send in place of `user` (deprecated for these)
                            "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                            # vLLM's: it shapes the text of slow (Python) tokenizers only; with a fast
                            # one, the only kind pdserve loads, vLLM ignores it too
                            "spaces_between_special_tokens"})


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries the "
                                                            "usage so far")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused by name (`check_supported`)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A field sent as null takes its default: OpenAI types most fields "... or null" (stream,
        n, echo, logprobs), vLLM's models take null for them, and typed clients send it. An
        unknown field sent as null asks nothing either: it is dropped, not refused. Fields in
        `_NULL_KEPT` mean something else by null (their model says what)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k in cls._NULL_KEPT
                or (k in cls.model_fields and cls.model_fields[k].default is None)}

    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    # Unset sampling fields take the model's generation_config.json defaults (vLLM's
    # --generation-config auto), else these: temperature 1, top_p 1, top_k 0, min_p 0,
    # repetition_penalty 1 (workers/generation_defaults.py).
    temperature: float | None = Field(None, description="0 = greedy (default: the model's, else 1)")
    top_p: float | None = Field(None, description="default: the model's, else 1")
    top_k: int | None = Field(None, description="0 or -1 disables (default: the model's, else 0)")
    min_p: float | None = Field(None, description="default: the model's, else 0")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, description="samples per prompt (at most the server's --max-n)")
    best_of: int | None = Field(None, description="accepted only equal to n: pdserve returns every sample")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="vLLM's: leave special tokens' text out of the output")
    include_stop_str_in_output: bool = Field(False, description="vLLM's: the stop string (or stop token's text) "
                                                                "ends the text")
    min_tokens: int = 0
    presence_penalty: float | None = Field(0.0, description="in [-2, 2]: minus this for each token already generated")
    frequency_penalty: float | None = Field(0.0, description="in [-2, 2]: minus this times each token's count so far")
    repetition_penalty: float | None = Field(None, description="> 0, 1 = off: divides the logits of tokens already "
                                                                "in the prompt or output (vLLM's extension; "
                                                                "default: the model's, else 1)")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100] added to its logit")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: logprobs name tokens 'token_id:<id>' "
                                                                      "(default: the server's)")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's: keep the prompt's last N tokens (-1: as "
                                                                 "many as the context holds)")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM's: the only token ids the output may hold")
    bad_words: list[str] | None = Field(None, description="vLLM's: words the output never holds (each as it "
                                                          "tokenizes alone and after a space; at most 128)")
    speculative: bool = Field(True, description="false: no speculative decoding for this request "
                                                "(when the server speculates)")
    cache_salt: str | None = Field(None, min_length=1,
                                   description="vLLM's: requests share prefix-cache blocks only with requests "
                                               "of the same salt (one per tenant keeps tenants apart)")
    user: str | None = Field(None, description="OpenAI's end-user id: accepted, not used")
    response_format: dict[str, object] | None = Field(
        None, description='{"type": "text"} (the default), {"type": "json_object"}, or {"type": "json_schema", '
                          '"json_schema": {"name": ..., "schema": {...}, "strict": ...}}')
    structured_outputs: dict[str, object] | None = Field(
        None, description="vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar (EBNF), "
                          "structural_tag")

    def constraint(self) -> StructuredOutputs | None:
        """What the output must match, from `response_format` or `structured_outputs` (one of
        them); a ValueError names the field at fault."""
        rf = self.response_format
        if rf is not None and rf != {"type": "text"}:
            if self.structured_outputs is not None:
                raise ValueError("response_format: give it or structured_outputs, not both")
            kind = rf.get("type")
            if kind == "json_object":
                return StructuredOutputs(json_object=True, origin="response_format")
            if kind != "json_schema":
                raise ValueError(f'response_format: type must be "text", "json_object" or "json_schema", got {kind!r}')
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ValueError("response_format.json_schema: must be an object with a schema object")
            try:  # no schema: any object (OpenAI's)
                return StructuredOutputs(json=spec.get("schema", {"type": "object"}),
                                         origin="response_format.json_schema.schema")
            except ValueError as e:
                raise ValueError(str(e).replace("structured_outputs.json", "response_format.json_schema.schema",
                                                1)) from None
        if self.structured_outputs is None:
            return None
        for own in ("origin", "after_token"):  # the server's own notes (where a spec came from, when it starts)
            if own in self.structured_outputs:
                raise ValueError(f"structured_outputs: unexpected keyword argument {own!r}")
        try:
            return StructuredOutputs(**self.structured_outputs)  # type: ignore[arg-type]  # checked there
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None

    def check_supported(self) -> None:
        """Refused (naming the field) for what pdserve would otherwise silently not do."""
        for name in sorted(self.model_extra or {}):
            if name not in IGNORED_FIELDS:
                raise Refused(name, "pdserve does not support this field", RefusalReason.UNSUPPORTED)

    def check_limits(self, limits: RequestLimits) -> None:
        """Refused (naming the field) when the request is over one of the server's bounds."""
        check_n(self.n, self.best_of, limits)
        check_stop(self.stop, self.stop_token_ids, limits)
        check_count("logit_bias", list(self.logit_bias or ()), limits.max_logit_bias, "max-logit-bias")
        if self.cache_salt is not None and len(self.cache_salt) > limits.max_cache_salt_length:
            raise Refused("cache_salt", f"at most {limits.max_cache_salt_length} characters")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict[str, float] | None = None) -> SamplingParams:
        """Raises ValueError naming the bad parameter. `defaults`: the model's sampling
        defaults (workers/generation_defaults.py) for the fields the request leaves unset."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        d = defaults or {}
        return SamplingParams(
            n=self.n, temperature=pick("temperature", self.temperature, d), top_p=pick("top_p", self.top_p, d),
            top_k=int(pick("top_k", self.top_k, d)), min_p=pick("min_p", self.min_p, d),
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty, d),
            logit_bias=self.logit_bias,  # type: ignore[arg-type]  # JSON's string keys: SamplingParams parses them
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            speculative=self.speculative, cache_salt=self.cache_salt, structured_outputs=self.constraint(),
            skip_special_tokens=self.skips_special_tokens(), include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def skips_special_tokens(self) -> bool:
        """Whether the output leaves special tokens' text out (the request's own field)."""
        return self.skip_special_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far in every chunk (vLLM's rule: only with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text or token ids, or a batch of either: prompt p's sample j is choice p * n + j")
    echo: bool = Field(False, description="put the prompt before each completion's text (and, with logprobs, "
                                         "the prompt tokens' logprobs before the generated ones'); "
                                         "with max_tokens 0, return only the prompt")
    # 16 when left out (OpenAI's default); null, as in vLLM: up to the end of the context.
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return this many top log-probs per token")

    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        if self.num_prompts > limits.max_prompts:
            raise Refused("prompt", f"at most {limits.max_prompts} prompts per request, got {self.num_prompts} "
                                    "(the server's --max-prompts)")


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, object] = "{}"  # OpenAI's is JSON text; an object is taken too


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of the conversation (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, object]] | None = None  # content parts: checked here (`check_supported`)
    # An assistant's earlier tool calls, and a tool's answer to one: the chat template renders them.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def template_dict(self, text: str) -> dict[str, object]:
        """The message as chat templates take it, with `text` as its content."""
        out: dict[str, object] = {"role": self.role, "content": text}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        # Parts joined by a newline, as vLLM renders them (its chat_utils: "\n".join(texts)).
        return "\n".join(str(part.get("text", "")) for part in self.content)

    def check_supported(self) -> None:
        """Text parts only: an image or audio part would otherwise be dropped unseen."""
        for part in self.content if isinstance(self.content, list) else ():
            if part.get("type") != "text":
                raise Refused("messages", f"pdserve takes text content parts only ({{\"type\": \"text\", "
                                          f"\"text\": ...}}), got type {str(part.get('type'))[:40]!r}",
                              RefusalReason.UNSUPPORTED)
            if not isinstance(part.get("text"), str):  # a client's mistake, not a part pdserve lacks
                raise Refused("messages", f"a text content part's text must be a string, got "
                                          f"{type(part.get('text')).__name__}", RefusalReason.MALFORMED)


def check_continuation(add_generation_prompt: bool, continue_final_message: bool,
                       messages: list[ChatMessage] | None) -> None:
    """vLLM's rules: the final message is continued, or a turn opened after it, not both; only
    an assistant's is continued."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError("continue_final_message: cannot be true with add_generation_prompt true")
    if messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, object]] | None = Field(None, description='functions the model may call: '
                                                 '[{"type": "function", "function": {"name", "description", '
                                                 '"parameters"}}]')
    tool_choice: str | dict[str, object] | None = Field(
        None, description='"none", "auto" (the default with tools), "required", or '
                          '{"type": "function", "function": {"name": ...}}; required and a named function are '
                          "enforced by a grammar")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (required)")
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="vLLM's: the last (assistant) message is left open, "
                                                            "for the model to continue")
    chat_template_kwargs: dict[str, object] | None = Field(
        None, description='vLLM\'s: more variables for the chat template, e.g. {"enable_thinking": false}')
    include_reasoning: bool = Field(True, description="vLLM's: with the server's --reasoning-parser, false leaves "
                                                      "the thinking out of the answer")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="OpenAI's: a chat template variable of that name (templates that read it, e.g. "
                          "gpt-oss's; the others ignore it); chat_template_kwargs' own wins")
    # The deprecated function-calling fields: modelled so that asking for them is a 400 naming
    # them, while their "off" values (what some clients send by default) pass.
    functions: list[dict[str, object]] | None = Field(None, description="not supported: only an empty list")
    function_call: str | dict[str, object] | None = Field(None, description='not supported: only "none"')

    def template_kwargs(self) -> dict[str, object] | None:
        """The chat template's variables the request gives: chat_template_kwargs, and its
        reasoning_effort where those do not set one (vLLM hands the template both)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def check_supported(self) -> None:
        super().check_supported()
        check_continuation(self.add_generation_prompt, self.continue_final_message, self.messages)
        check_template_kwargs(self.chat_template_kwargs)
        if self.functions:
            raise Refused("functions", "deprecated: use tools", RefusalReason.UNSUPPORTED)
        if self.function_call not in (None, "none"):
            raise Refused("function_call", 'deprecated: use tool_choice (only "none" here)', RefusalReason.UNSUPPORTED)
        for m in self.messages:
            m.check_supported()

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        check_count("messages", self.messages, limits.max_messages, "max-messages")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def budget_field(self) -> str:
        """The field `max_new_tokens` came from, for errors to name."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def tool_plan(self) -> ToolPlan:
        """What `tools` and `tool_choice` ask (a ValueError names the field at fault)."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def skips_special_tokens(self) -> bool:
        """Not while "auto" tool calls are parsed from the text: a call's marker can be a special
        token (Mistral's [TOOL_CALLS]), and left out it was no call (vLLM's and SGLang's tool
        parsers turn skip_special_tokens off too)."""
        return self.skip_special_tokens and self.tool_plan().mode != "auto"

    def constraint(self) -> StructuredOutputs | None:
        """`response_format`/`structured_outputs`, or the grammar a required or named tool call
        needs (not both)."""
        own = super().constraint()
        calls = self.tool_plan().constraint()
        if calls is not None and own is not None:
            raise ValueError('tool_choice: a required or named call cannot go with response_format or '
                             'structured_outputs')
        return own or calls

    def num_logprobs(self) -> int | None:
        # vLLM's rule: asking for some (> 0) needs logprobs; 0 asks for none, and is taken without.
        # A negative count is refused whether or not logprobs is set (vLLM's -1, the whole
        # vocabulary, is past any --max-logprobs but -1 there; pdserve does not offer it).
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"top_logprobs: must be a non-negative integer, got {self.top_logprobs}")
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses --------------------------------------------------------------------


class ErrorObject(TypedDict):
    message: str
    type: str
    param: str | None  # the request field at fault
    code: int  # the HTTP status


class ErrorBody(TypedDict):
    error: ErrorObject


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int  # the answer's tokens through the end of its thinking (a reasoning parser's)


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: NotRequired[CompletionTokensDetails]  # with a reasoning parser


class TextLogprobs(TypedDict):
    """/v1/completions' logprobs, one entry per reported token (None: an echoed prompt's first token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # token text -> log-prob
    text_offset: list[int]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    """/v1/chat/completions' logprobs."""

    content: list[TokenLogprob]


Logprobs = TextLogprobs | ChatLogprobs


class TextChoice(TypedDict):
    """A /v1/completions choice: of a whole response, or of a chunk (then `text` is what it adds)."""

    index: int
    text: str
    logprobs: Logprobs | None
    finish_reason: str | None
    # vLLM's: the stop string or stop token id that ended the choice (None: EOS or length); in a
    # stream, on the choice's last chunk only
    stop_reason: NotRequired[int | str | None]


class AssistantMessage(TypedDict):
    role: str
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]
    # With the server's --reasoning-parser: the thinking (vLLM's name, and its older one)
    reasoning: NotRequired[str | None]
    reasoning_content: NotRequired[str | None]


class ChatChoice(TypedDict):
    """A /v1/chat/completions choice of a whole response."""

    index: int
    message: AssistantMessage
    logprobs: Logprobs | None
    finish_reason: str | None
    # vLLM's: the stop string or stop token id that ended the choice (None: EOS or length); in a
    # stream, on the choice's last chunk only
    stop_reason: NotRequired[int | str | None]


class ChatDelta(TypedDict):
    role: NotRequired[str]  # in a stream's opening chunk only
    content: NotRequired[str | None]
    tool_calls: NotRequired[list[StreamedToolCall]]
    reasoning: NotRequired[str]  # with the server's --reasoning-parser: thinking, apart from the content
    reasoning_content: NotRequired[str]


class ChatChunkChoice(TypedDict):
    """A /v1/chat/completions choice of a chunk."""

    index: int
    delta: ChatDelta
    logprobs: NotRequired[Logprobs | None]  # not in the opening chunk
    finish_reason: str | None
    # vLLM's: the stop string or stop token id that ended the choice (None: EOS or length); in a
    # stream, on the choice's last chunk only
    stop_reason: NotRequired[int | str | None]


class ResponseBody(TypedDict):
    """A whole (not streamed) response."""

    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice | ChatChoice]
    usage: Usage


class ChunkBody(TypedDict):
    """One event of a streamed response."""

    id: str
    object: str
    created: int
    model: str
    choices: list[TextChoice | ChatChunkChoice]
    usage: NotRequired[Usage]  # the last chunk's, when the request asked for it (`include_usage`)


class ModelPermission(BaseModel):
    """vLLM's permission entry of a model card (OpenAI's legacy field): sampling, logprobs and
    viewing allowed, nothing else; clients written for vLLM read it."""

    id: str = Field(default_factory=lambda: new_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """One served name in GET /v1/models, as vLLM describes it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str  # vLLM's: the tokenizer's name or path
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


MAX_PARAM_CHARS = 64  # an error's `param` names a field: a client's 200,000-character key is cut


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> ErrorBody:
    """OpenAI's error object. What a client sent may be in the message or the param (a model
    name, a field's name): lone surrogates are escaped (UTF-8 cannot carry them: the response
    would fail to encode, a 500) and a param is cut to MAX_PARAM_CHARS."""
    if param is not None:
        param = _utf8_safe(param if len(param) <= MAX_PARAM_CHARS else param[:MAX_PARAM_CHARS] + "...")
    return {"error": {"message": _utf8_safe(message), "type": err_type, "param": param, "code": code}}


def _utf8_safe(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(16).hex()}"  # uuid4's 128 random bits, without its object


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
