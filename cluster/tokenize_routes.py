"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer, over HTTP.

Clients count a prompt's tokens before they send it (against `max_model_len`, or to bill),
and turn token ids from logprobs back into text, with the tokenizer the server uses (its
chat template included), not a copy that may differ. The shapes are vLLM's:

    POST /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                   or {"model", "messages", "tools", "add_generation_prompt": true,
                       "add_special_tokens": false, "return_token_strs": false}
                   -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

Nothing runs on a worker. The work goes to the gateway's tokenizer pool (off the event loop
when long), within the request deadline; the body's size bounds it (the guard's limit). A
text is tokenized whatever its length, as vLLM does: counting a prompt too long for the
context is what the route is for. Any field not listed is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pdserve.cluster.api_errors import APIError, bad_request, unicode_text
from pdserve.cluster.gateway import TEMPLATE_CHARS_PER_MESSAGE, Gateway
from pdserve.cluster.limits import RefusalReason
from pdserve.cluster.protocol import ChatMessage, check_continuation
from pdserve.cluster.tool_calls import ToolPlan
from pdserve.workers.inputs import check_token_ids

ENDPOINTS = frozenset({"/tokenize", "/detokenize"})
# /tokenize counts texts longer than the context too, but not without end: a 4 MB text held
# the tokenizer pool's long lane ~10 s (the prompts behind it waited) and answered 20 MB.
# At most four contexts' worth of characters (the prompt bound's measure), and never over
# MAX_TOKENIZE_CHARS (~2 s of tokenizing on two cores). /detokenize likewise takes at most four
# contexts of ids: the 16 MiB body holds 8 M, ~4.5 s of decoding and a ~37 MB answer.
MAX_TOKENIZE_CHARS = 1 << 20
CONTEXTS_COUNTED = 4


def max_tokenize_chars(gw: Gateway) -> int:
    """The most characters a /tokenize text may have on this gateway."""
    if gw.char_bound is None:
        return MAX_TOKENIZE_CHARS
    return min(MAX_TOKENIZE_CHARS, CONTEXTS_COUNTED * gw.char_bound.max_chars)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, description="a text (give it or messages)")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                               description="a chat, rendered by the model's chat template")
    tools: list[dict[str, object]] | None = Field(None, description="with messages: rendered into the template")
    add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="with messages: leave the last (assistant) message "
                                                            "open, for the model to continue")
    chat_template_kwargs: dict[str, object] | None = Field(None, description="with messages: more variables for "
                                                                          "the chat template (vLLM's)")
    add_special_tokens: bool | None = Field(None, description="default: true with prompt, false with messages "
                                                              "(the template writes its own)")
    return_token_strs: bool = Field(False, description="also each token as the tokenizer spells it")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]  # not true or 1.0 taken for an id


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenizer_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        gw.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", "BadRequestError",
                           "prompt" if body.prompt is None else "messages", reason=RefusalReason.MALFORMED)
        size = _size(body)
        most = max_tokenize_chars(gw)
        if size > most:
            raise APIError(400, f"at most {most} characters to tokenize, got {size}", "BadRequestError",
                           "prompt" if body.prompt is not None else "messages", reason=RefusalReason.LIMIT)
        ids, strs = await gw.in_pool(size, lambda: _tokens(gw, body), may_inline=not body.tools)
        return TokenizeResponse(count=len(ids), max_model_len=gw.config.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        gw.check_model(body.model)
        vocab = gw.vocab_size if gw.vocab_size is not None else len(gw.tokenizer)
        most = CONTEXTS_COUNTED * gw.config.max_model_len
        if len(body.tokens) > most:  # before the ids are checked: that too runs on the event loop
            raise APIError(400, f"tokens: at most {most} token ids to detokenize ({CONTEXTS_COUNTED} contexts' "
                                f"worth), got {len(body.tokens)}", "BadRequestError", "tokens",
                           reason=RefusalReason.LIMIT)
        if body.tokens:
            try:
                check_token_ids(body.tokens, vocab)
            except ValueError as e:
                raise bad_request(ValueError(str(e).replace("prompt:", "tokens:", 1))) from None
        text = await gw.in_pool(len(body.tokens), lambda: str(gw.tokenizer.decode(body.tokens)))
        return DetokenizeResponse(prompt=text)


def _size(body: TokenizeRequest) -> int:
    """What tokenizing `body` costs, as the chat route measures it (gateway.prompt_chars): a
    chat's template costs per message whatever its text, so a chat of many short messages is
    rendered on a thread (not on the event loop) and counts against MAX_TOKENIZE_CHARS."""
    if body.prompt is not None:
        return len(body.prompt)
    return sum(len(m.text()) + TEMPLATE_CHARS_PER_MESSAGE for m in body.messages or ())


def _tokens(gw: Gateway, body: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """The ids, and their strings if asked. Blocking: in the tokenizer pool."""
    tokenizer: Any = gw.tokenizer
    if body.messages is None:
        if body.continue_final_message:
            raise bad_request(ValueError("continue_final_message: only with messages"))
        if body.chat_template_kwargs is not None:
            raise bad_request(ValueError("chat_template_kwargs: only with messages"))
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(tokenizer.encode(unicode_text("prompt", body.prompt or ""), add_special_tokens=special))
    else:
        try:
            for m in body.messages:
                m.check_supported()
            check_continuation(body.add_generation_prompt, body.continue_final_message, body.messages)
            tools = ToolPlan.of(body.tools, None, None).template_tools()
        except ValueError as e:
            raise bad_request(e) from None
        text = gw.chat_text(body.messages, tools, body.add_generation_prompt, body.continue_final_message,
                            body.chat_template_kwargs)
        ids = list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))
    strs = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)] if body.return_token_strs else None
    return ids, strs
