"""FastAPI routes of the OpenAI-compatible API, over a `Gateway`.

`build_app(gw)` returns the ASGI app; Ray Serve wraps it as the cluster's
ingress (cluster/serve_app.py), tests run it under uvicorn over an in-process
engine. Every request ends with a terminal event: a final chunk + `[DONE]`
(stream), a response body, or an error object. A client that disconnects
aborts its request in the backend, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.cluster.gateway import APIError, Gateway, Work
from pdserve.cluster.metrics import RequestCounter, RequestMetrics
from pdserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now
from pdserve.cluster.responses import ApiKind, collect_response, stream_response

ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


def build_app(gw: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The backend starts on its first request (a disaggregated one waits for its
        # workers' first load reports then); the app's shutdown closes it.
        yield
        await gw.backend.close()

    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster", version="0.1.0",
                  lifespan=lifespan)
    app.add_middleware(RequestCounter, counter=gw.requests_total, endpoints=ENDPOINTS)
    _add_error_handlers(app, gw)
    _add_info_routes(app, gw)
    _add_generation_routes(app, gw)
    return app


def _add_error_handlers(app: FastAPI, gw: Gateway) -> None:
    # Every failed request passes one of these two handlers (the stream reports its
    # errors in-band: stream_response counts those): the one place errors are counted.
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        gw.metrics.error(e.status)
        return JSONResponse(error_body(e.message, e.err_type, e.status, e.param), status_code=e.status,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        gw.metrics.error(400)
        # OpenAI clients expect 400 with the error object, not FastAPI's 422.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(msg, "BadRequestError", 400, param), status_code=400)


def _add_info_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 while a request can be served (the body says "degraded" when a pool
        is short of workers); 503 only when none can."""
        h = gw.backend.health()
        if not h.serving:
            body = error_body("no healthy worker in a needed pool", "ServiceUnavailableError", 503)
            return JSONResponse({**body, **h.body()}, 503)
        return JSONResponse(h.body(), 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await gw.metrics.exposition(gw.worker_handles()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw.check_auth(request.headers.get("authorization", ""))
        # vLLM's model card, one per served name: `vllm bench serve` with no --model
        # takes data[0]'s `id` as the model and its `root` as the tokenizer.
        created, cfg = now(), gw.config
        root = cfg.model_root if cfg.model_root is not None else cfg.model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "pdserve",
                                            "root": root, "parent": None, "max_model_len": cfg.max_model_len}
                                           for name in cfg.served_names]}


def _add_generation_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        gw.check_auth(request.headers.get("authorization", ""))
        gw.check_model(body.model)
        # echo + logprobs: the prompt's logprobs too; echo + max_tokens 0: the prompt alone
        # (one token is generated and dropped: a request always samples).
        prompt_lp = body.logprobs if body.echo else None
        prompt_only = body.echo and body.max_tokens == 0
        works: list[Work] = []
        for ids, text in gw.prompts(body.prompt):
            params = gw.params(ids, 1 if prompt_only else body.max_tokens,
                               lambda mt: body.sampling_params(mt, body.logprobs, prompt_lp))
            echo = (text if text is not None else gw.tokenizer.decode(ids)) if body.echo else None
            works.append(Work(ids, params, echo, prompt_only))
        return await _respond(gw, request, ApiKind.COMPLETION, body.stream, body.include_usage, works, rm)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        gw.check_auth(request.headers.get("authorization", ""))
        gw.check_model(body.model)
        try:
            num_logprobs = body.num_logprobs()
        except ValueError as e:
            raise APIError(400, str(e), "BadRequestError", "top_logprobs") from None
        prompt_ids = gw.chat_prompt(body)
        params = gw.params(prompt_ids, body.max_new_tokens(), lambda mt: body.sampling_params(mt, num_logprobs))
        works = [Work(prompt_ids, params)]
        return await _respond(gw, request, ApiKind.CHAT, body.stream, body.include_usage, works, rm)


async def _respond(gw: Gateway, request: Request, kind: ApiKind, stream: bool, include_usage: bool,
                   works: list[Work], rm: RequestMetrics) -> Response:
    gw.admit(sum(w.params.n for w in works))
    rid = new_id(kind.shape.id_prefix)
    if stream:
        # Starlette cancels this generator when the client disconnects; the
        # backend's generate() then aborts the request and frees its blocks.
        events = stream_response(gw, kind, rid, works, include_usage, rm)
        return StreamingResponse(events, media_type="text/event-stream")
    body = await _until_disconnect(request, collect_response(gw, kind, rid, works, rm))
    return JSONResponse(body)


async def _until_disconnect(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
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
