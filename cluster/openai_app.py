"""FastAPI routes of the OpenAI-compatible API, over a `Gateway`.

`build_app(gw)` returns the ASGI app; Ray Serve wraps it as the cluster's
ingress (cluster/serve_app.py), tests run it under uvicorn over an in-process
engine. Every request ends with a terminal event: a final chunk + `[DONE]`
(stream), a response body, or an error object. A client that disconnects
aborts its request in the backend, which frees its KV blocks. Keys, body
limits and write timeouts act before the routes (http_guard.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from pdserve import __version__
from pdserve.cluster.api_errors import RETRY_AFTER, APIError, bad_request
from pdserve.cluster.cors import add_cors
from pdserve.cluster.gateway import Admission, Gateway, Work
from pdserve.cluster.http_guard import Guard, Keys, request_id
from pdserve.cluster.limits import RefusalReason
from pdserve.cluster.metrics import RequestCounter, RequestMetrics
from pdserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body, now
from pdserve.cluster.reasoning import ReasoningPlan
from pdserve.cluster.responses import ApiKind, collect_response, json_text, stream_response
from pdserve.cluster.responses_api import ResponsesRequest, responses_error, stream_responses, whole_response
from pdserve.cluster.tokenize_routes import ENDPOINTS as TOKENIZER_ENDPOINTS
from pdserve.cluster.tokenize_routes import add_tokenizer_routes

log = logging.getLogger(__name__)
REPLICA_HEADER = b"x-pdserve-replica"  # the gateway replica's rank, on every response (docs/api.md)
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/ping",
                       "/invocations", "/version", "/metrics", *TOKENIZER_ENDPOINTS})
T = TypeVar("T")
# FastAPI's own OpenTelemetry (0.165 and later), off: its checks of the global providers on every request.
TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False}


def telemetry_options(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """FastAPI's `telemetry` argument: off unless the environment configures OpenTelemetry.
    Why: from 0.165 FastAPI asks OpenTelemetry for its global providers on every request, even
    where none is configured: ~18 us of a gateway's CPU a one-token request (~2%; alternating
    door runs, docs/front-door.md). The gateway's figures are its Prometheus metrics. An
    `OTEL_*` variable (what `opentelemetry-instrument` and the SDK read) or FastAPI's own
    `FASTAPI_OTEL_AUTO_CONFIGURE` leaves FastAPI's default (on). Empty for a FastAPI
    without the argument."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    if environ.get("FASTAPI_OTEL_AUTO_CONFIGURE") or any(k.startswith("OTEL_") for k in environ):
        return {}
    return {"telemetry": dict(TELEMETRY_OFF)}


def build_app(gw: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The backend starts on its first request (a disaggregated one waits for its
        # workers' first load reports then); the app's shutdown closes it. The planner
        # loop (if any) runs from startup: its first window starts then.
        gw.start_planner()
        yield
        await gw.close()

    cfg = gw.config
    no_docs: dict[str, Any] = {} if cfg.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster", version="0.1.0",
                  lifespan=lifespan, **telemetry_options(), **no_docs)
    # Added first, so inside the counter: the counter sees the guard's refusals too.
    app.add_middleware(Guard, keys=Keys(cfg.api_key, cfg.metrics_api_key), limits=cfg.limits,
                       on_refused=gw.metrics.refuse, echo_request_id=not cfg.server_writes_request_id)
    # Outside the guard: its refusals are counted, and name the replica, too.
    app.add_middleware(RequestCounter, counter=gw.requests_total, endpoints=ENDPOINTS,
                       headers=((REPLICA_HEADER, str(cfg.replica).encode()),))
    add_cors(app, cfg.cors)  # outermost
    _add_error_handlers(app, gw)
    _add_info_routes(app, gw)
    _add_generation_routes(app, gw)
    add_tokenizer_routes(app, gw)
    return app


def _add_error_handlers(app: FastAPI, gw: Gateway) -> None:
    # Every failed request passes one of these handlers or the guard's refusals (the
    # stream reports its errors in-band: stream_response counts those): the one place
    # errors are counted. None sends more than a message, a type and a field name.
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        gw.metrics.refuse(e.reason, e.status)
        return JSONResponse(error_body(e.message, e.err_type, e.status, e.param), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        gw.metrics.refuse(RefusalReason.MALFORMED, 400)
        msg, param = _validation_message(e, request.headers.get("content-type"))
        return JSONResponse(error_body(msg, "BadRequestError", 400, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        # An unknown route or method, or a body FastAPI could not decode (not UTF-8).
        gw.metrics.refuse(RefusalReason.MALFORMED if e.status_code == 400 else None, e.status_code)
        err_type = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
            e.status_code, "HTTPError")
        return JSONResponse(error_body(str(e.detail), err_type, e.status_code), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        # Starlette logs the traceback (under the request id: the guard put it in the
        # response's x-request-id); the client gets the id, never the traceback.
        rid = request_id(request.scope)
        log.error("request %s: unhandled error", rid, exc_info=e)
        gw.metrics.error(500)
        return JSONResponse(error_body(f"internal error (request id {rid}): the server log has the details",
                                       "InternalServerError", 500), status_code=500)


def _validation_message(e: RequestValidationError, content_type: str | None) -> tuple[str, str | None]:
    """(message, param) of a body FastAPI refused: OpenAI clients expect a 400 with the error
    object, not FastAPI's 422. The message names the field and the rule, never the input (it can
    be huge); `param` is a field's name or None (a JSON parser's position is no field)."""
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return f"body: not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"[:500], None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc and "json" not in (content_type or "").lower():  # a JSON object sent as text/plain, or untyped
        return f"body: Content-Type must be application/json, got {(content_type or 'none')[:100]!r}", None
    param = loc[0] if loc and not loc[0].isdigit() else None
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"[:500], param


def _add_info_routes(app: FastAPI, gw: Gateway) -> None:
    # vLLM's /ping (SageMaker's health check, GET or POST) answers as /health does.
    @app.get("/ping", operation_id="health_ping_get")
    @app.post("/ping", operation_id="health_ping_post")  # (one api_route for both gave both one id)
    @app.get("/health")
    async def health() -> Response:
        """200 while a request can be served (the body says "degraded" when a pool
        is short of workers); 503 when none can, or while the server stops ("draining")."""
        h = gw.backend.health()
        if gw.draining:  # a load balancer stops sending it requests
            body = error_body("the server is shutting down", "ServiceUnavailableError", 503)
            return JSONResponse({**body, **h.body(), "status": "draining"}, 503, headers=RETRY_AFTER)
        if not h.serving:
            body = error_body("no healthy worker in a needed pool", "ServiceUnavailableError", 503)
            return JSONResponse({**body, **h.body()}, 503, headers=RETRY_AFTER)
        return JSONResponse(h.body(), 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's /version: the server's version (behind the API key, as every path but the health checks)."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await gw.metrics.exposition(gw.worker_handles()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        # vLLM's model card, one per served name: `vllm bench serve` with no --model
        # takes data[0]'s `id` as the model and its `root` as the tokenizer.
        created, cfg = now(), gw.config
        root = cfg.model_root if cfg.model_root is not None else cfg.model_name
        return ModelList(data=[ModelCard(id=name, created=created, root=root, max_model_len=cfg.max_model_len)
                               for name in cfg.served_names])

    @app.get("/v1/models/{model:path}")  # (a served name may hold a "/": "meta-llama/Llama-3.1-8B")
    async def model(model: str) -> ModelCard:
        """OpenAI's "retrieve model" (`client.models.retrieve`), which vLLM lacks: the card of a
        served name, or a 404 naming the model."""
        for card in (await models()).data:
            if card.id == model:
                return card
        raise APIError(404, f"The model `{model[:200]}` does not exist.", "NotFoundError", "model")


def _add_generation_routes(app: FastAPI, gw: Gateway) -> None:
    # Each route: refuse what can be refused for free (a prompt too long for the
    # context included: gw.check_request), take the admission slot (at once: no
    # await between its check and its count), then tokenize in the gateway's pool,
    # off the event loop; the slot is held until the response is done.
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        gw.check_request(body)
        slot = gw.admit(body.num_prompts * body.n)
        try:
            works = await gw.off_loop(body, lambda: _completion_works(gw, body))
            await gw.check_grammar(works[0].params)  # one spec for every prompt of the request
        except BaseException:
            slot.release()
            raise
        return await _respond(gw, request, ApiKind.COMPLETION, body.stream, body.include_usage, works, rm, slot,
                              body.continuous_usage)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        works, slot = await _chat_works(gw, body)
        return await _respond(gw, request, ApiKind.CHAT, body.stream, body.include_usage, works, rm, slot,
                              body.continuous_usage)

    # vLLM's /invocations (SageMaker's inference path, beside /ping): a chat request (it has
    # `messages`) or a completion (`prompt`), served as that endpoint serves it.
    @app.post("/invocations", include_in_schema=False)
    async def invocations(request: Request) -> Response:
        try:
            data = await request.json()
        except ValueError:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                           "input": None}]) from None
        kind: type[ChatCompletionRequest] | type[CompletionRequest] | None = None
        if isinstance(data, dict):
            kind = ChatCompletionRequest if "messages" in data else CompletionRequest if "prompt" in data else None
        if kind is None:
            raise APIError(400, "a chat request (with messages) or a completion request (with prompt)",
                           "BadRequestError", reason=RefusalReason.MALFORMED)
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        return await (chat(body, request) if isinstance(body, ChatCompletionRequest) else completions(body, request))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, run as the chat request it amounts to (responses_api.py)."""
        rm = gw.metrics.request()
        works, slot = await _responses_works(gw, body)
        rid = f"resp_{request_id(request.scope)}"
        if body.stream:
            return _AdmittedStream(stream_responses(gw, body, rid, works, rm), slot)
        try:
            out = await _until_disconnect(request, collect_response(gw, ApiKind.CHAT, rid, works, rm))
        except APIError as e:  # (a refusal from the worker: a grammar that cannot go on)
            raise responses_error(e) from None
        finally:
            slot.release()
        return OutputResponse(whole_response(body, rid, out))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], include_in_schema=False)
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"no response {response_id[:100]!r}: pdserve does not store responses",
                       "NotFoundError", "response_id")


async def _responses_works(gw: Gateway, body: ResponsesRequest) -> tuple[list[Work], Admission]:
    """A Responses request's chat work and its admission slot (`_chat_works`), its refusals
    named as it names its fields. With truncation "auto", an input over the context loses the
    fewest leading turns that make it fit (OpenAI's rule), found by a binary search: each try
    tokenizes, so a long conversation costs a few tries, not one a turn."""
    async def attempt(drop: int) -> tuple[list[Work], Admission]:
        try:
            chat = body.chat_request(drop)
        except ValueError as e:
            raise bad_request(e) from None
        try:
            return await _chat_works(gw, chat)
        except APIError as e:
            raise responses_error(e) from None

    try:
        return await attempt(0)
    except APIError as e:
        turns = len(body.turns())
        if body.truncation != "auto" or not e.over_context or not turns:
            raise
        last = e
    best: tuple[list[Work], Admission] | None = None
    lo, hi = 1, turns  # the fewest turns dropped that fit: dropping more only shortens it
    try:
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                got = await attempt(mid)
            except APIError as e:
                if not e.over_context:
                    raise
                last, lo = e, mid + 1
                continue
            if best is not None:
                best[1].release()
            best, hi = got, mid - 1
    except BaseException:
        if best is not None:
            best[1].release()
        raise
    if best is None:
        raise last  # even its last turn alone does not fit
    return best


async def _chat_works(gw: Gateway, body: ChatCompletionRequest) -> tuple[list[Work], Admission]:
    """A chat request checked, admitted and tokenized: its work, and the admission slot its
    response must release (released here if it fails first)."""
    gw.check_request(body)
    try:
        num_logprobs = body.num_logprobs()
    except ValueError as e:
        raise APIError(400, str(e), "BadRequestError", "top_logprobs", reason=RefusalReason.MALFORMED) from None
    try:
        tools = body.tool_plan()
        if gw.config.tool_call_parser is not None:
            tools = dataclasses.replace(tools, parser=gw.config.tool_call_parser)
    except ValueError as e:
        raise bad_request(e) from None
    slot = gw.admit(body.n)
    try:
        prompt_ids, closed = await gw.off_loop(body, lambda: gw.chat_prompt(body))
        params = gw.params(prompt_ids, body.max_new_tokens(),
                           lambda mt: body.sampling_params(mt, num_logprobs, defaults=gw.config.sampling_defaults),
                           body.budget_field(), "top_logprobs", "messages")
        await gw.check_grammar(params)
    except BaseException:
        slot.release()
        raise
    reasoning = ReasoningPlan.of(gw.config.reasoning_parser, gw.template_kwargs(body.template_kwargs()),
                                 body.include_reasoning, end=gw.thinking_end, closed=closed)
    so = params.constraint
    if so is not None:
        end_token = gw.thinking_end.token_id if gw.thinking_end is not None else None
        if reasoning is not None and end_token is not None:
            # A thinking answer: its grammar (response_format, a required or named tool call)
            # applies after the thinking, as vLLM's does with a reasoning parser.
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after_token=end_token))
        else:
            reasoning = None  # the grammar applies from the first token: the answer is all content
    return [Work(prompt_ids, params, tools=tools, reasoning=reasoning,
                 tokens_as_ids=_tokens_as_ids(gw, body.return_tokens_as_token_ids))], slot


def _completion_works(gw: Gateway, body: CompletionRequest) -> list[Work]:
    """The request's prompts, tokenized and checked (blocking: in the tokenizer pool)."""
    # echo + logprobs: the prompt's logprobs too; echo + max_tokens 0: the prompt alone
    # (one token is generated and dropped: a request always samples).
    prompt_lp = body.logprobs if body.echo else None
    prompt_only = body.echo and body.max_tokens == 0
    works: list[Work] = []
    for ids, text in gw.prompts(body.prompt, body.truncate_prompt_tokens):
        params = gw.params(ids, 1 if prompt_only else body.max_tokens,
                           lambda mt: body.sampling_params(mt, body.logprobs, prompt_lp,
                                                          defaults=gw.config.sampling_defaults))
        echo = (text if text is not None else gw.tokenizer.decode(ids)) if body.echo else None
        works.append(Work(ids, params, echo, prompt_only,
                          tokens_as_ids=_tokens_as_ids(gw, body.return_tokens_as_token_ids)))
    return works


def _tokens_as_ids(gw: Gateway, asked: bool | None) -> bool:
    return gw.config.return_tokens_as_token_ids if asked is None else asked


async def _respond(gw: Gateway, request: Request, kind: ApiKind, stream: bool, include_usage: bool,
                   works: list[Work], rm: RequestMetrics, slot: Admission, continuous_usage: bool) -> Response:
    """The response of admitted `works`; it releases `slot` when it is done."""
    rid = f"{kind.shape.id_prefix}-{request_id(request.scope)}"
    if stream:
        # vLLM's --enable-force-include-usage: every stream ends with its usage, asked or not
        include_usage = include_usage or gw.config.force_include_usage
        # Starlette cancels this generator when the client disconnects; the
        # backend's generate() then aborts the request and frees its blocks.
        return _AdmittedStream(stream_response(gw, kind, rid, works, include_usage, rm, continuous_usage), slot)
    try:
        body = await _until_disconnect(request, collect_response(gw, kind, rid, works, rm))
    finally:
        slot.release()
    return OutputResponse(body)


class OutputResponse(JSONResponse):
    """A whole (not streamed) response of model output, written as its streamed chunks are
    (`json_text`): Starlette's JSONResponse fails on what a model may write (a lone surrogate in
    a tool call's arguments, an infinite logprob), a 500 for a request that worked."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode()


class _AdmittedStream(Response):
    """An SSE stream that holds its request's admission slot until it ends, however
    it ends: finished, the client gone, or dropped for not reading (the guard's
    write timeout). Its events are closed then, which aborts a request still running.

    Not Starlette's StreamingResponse: under an ASGI 2.3 server (uvicorn) that one runs
    each stream in an anyio task group of two tasks to hear a disconnect, and encodes
    each chunk again. Here the stream runs in one task of its own and one plain task
    listens, cancelling it when the client goes (docs/front-door.md)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], slot: Admission) -> None:
        self.status_code, self.background = 200, None
        # As OpenAI's streams: no cache may keep (or a proxy hold back) an event stream.
        self.init_headers({"cache-control": "no-cache"})
        self._events, self._slot = events, slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _unless_disconnected(self._stream(send), receive)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._slot.release()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _unless_disconnected(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run `work` in a task of its own and wait for it; when the client disconnects
    first, cancel it and return. Its own task, because every token wakes the task that
    streams: in the request's task each wake resumes (and each wait unwinds) the ~30
    coroutine frames of Serve's replica, FastAPI and the middleware between the server
    and this response; in its own task only the stream's (~3 us a token at one token
    a chunk: docs/front-door.md). Cancelling this task cancels `work` too."""
    me = asyncio.current_task()
    assert me is not None
    stream = asyncio.ensure_future(work)  # (it keeps this task's context: the request's ids)
    gone = False

    async def listen() -> None:
        nonlocal gone
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a server that cannot say what the client does: taken as gone
            log.warning("stream: the server's receive failed; taking the client as gone", exc_info=True)
        if not stream.done():
            gone = True
            stream.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        await stream  # its error (a write timeout: the guard's) is this task's
    except asyncio.CancelledError:
        # The stream cancelled for its client, and handled: the request's task goes on to
        # its cleanup. This task cancelled (by the server): it stays cancelled.
        if not gone or me.cancelling() > 0:
            raise
    finally:
        listener.cancel()
        if not stream.done():  # (only if this task was cancelled and the stream would not end)
            stream.cancel()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts the request) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "ClientClosedRequest")
    finally:
        if not task.done():
            task.cancel()
