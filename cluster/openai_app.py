"""FastAPI routes of the OpenAI-compatible API, over a `Gateway`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.cluster.gateway import APIError, Gateway, Work, _Choice, bad_request, status_of
from pdserve.cluster.metrics import RequestCounter, RequestMetrics
from pdserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage
from pdserve.workers.outputs import RequestOutput

Kind = str  # "completion" | "chat"
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


def build_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a pdserve cluster", version="0.1.0")
    app.add_middleware(RequestCounter, counter=gw.requests_total, endpoints=ENDPOINTS)

    # Every failed request passes one of these two handlers (the stream reports
    # its errors in-band: _sse counts those): the one place errors are counted.
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        gw.metrics.error(e.status)
        return JSONResponse(error_body(e.message, e.err_type, e.status, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        gw.metrics.error(400)
        # OpenAI clients expect 400 with the error object, not FastAPI's 422.
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(msg, "BadRequestError", 400, param), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        if not gw.backend.healthy:
            return JSONResponse(error_body("no healthy worker in a needed pool", "ServiceUnavailableError", 503), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await gw.metrics.exposition(gw.worker_handles()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw.check_auth(request)
        return {"object": "list", "data": [{"id": gw.config.model_name, "object": "model", "created": now(),
                                            "owned_by": "pdserve", "max_model_len": gw.config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        gw.check_auth(request)
        gw.check_model(body.model)
        # echo + logprobs: the prompt's logprobs too; echo + max_tokens 0: the prompt alone
        # (one token is generated and dropped: a request always samples).
        prompt_lp = body.logprobs if body.echo else None
        prompt_only = body.echo and body.max_tokens == 0
        works = []
        for ids, text in gw.prompts(body.prompt):
            params = gw.params(ids, 1 if prompt_only else body.max_tokens,
                               lambda mt: body.sampling_params(mt, body.logprobs, prompt_lp))
            echo = (text if text is not None else gw.tokenizer.decode(ids)) if body.echo else None
            works.append(Work(ids, params, echo, prompt_only))
        return await _respond(gw, request, "completion", body.stream, body.include_usage, works, rm)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        rm = gw.metrics.request()  # arrival: TTFT and E2E count from here
        gw.check_auth(request)
        gw.check_model(body.model)
        try:
            num_logprobs = body.num_logprobs()
        except ValueError as e:
            raise APIError(400, str(e), "BadRequestError", "top_logprobs") from None
        prompt_ids = gw.chat_prompt(body)
        params = gw.params(prompt_ids, body.max_new_tokens(), lambda mt: body.sampling_params(mt, num_logprobs))
        return await _respond(gw, request, "chat", body.stream, body.include_usage, [Work(prompt_ids, params)], rm)

    return app


async def _respond(gw: Gateway, request: Request, kind: Kind, stream: bool, include_usage: bool,
                   works: list[Work], rm: RequestMetrics) -> Response:
    gw.admit(sum(w.params.n for w in works))
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    if stream:
        # Starlette cancels this generator when the client disconnects; the
        # backend's generate() then aborts the request and frees its blocks.
        return StreamingResponse(_sse(gw, kind, rid, works, include_usage, rm), media_type="text/event-stream")
    body = await _until_disconnect(request, _collect(gw, kind, rid, works, rm))
    return JSONResponse(body)


def _choices(works: list[Work]) -> list[_Choice]:
    """Prompt p's sample j is choice p * n + j."""
    return [_Choice(i) for i in range(sum(w.params.n for w in works))]


def _work_of(works: list[Work], index: int) -> Work:
    return works[index // works[0].params.n]


def _usage(works: list[Work], choices: list[_Choice]) -> dict[str, Any]:
    n = works[0].params.n
    return usage(sum(len(w.prompt_ids) for w in works), sum(len(c.token_ids) for c in choices),
                 sum(choices[p * n].cached_tokens for p in range(len(works))))


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


async def _collect(gw: Gateway, kind: Kind, rid: str, works: list[Work], rm: RequestMetrics) -> dict[str, Any]:
    choices = _choices(works)
    rm.admitted(sum(len(w.prompt_ids) for w in works))
    try:
        async for i, out in gw.run(rid, works):
            rm.output(out)  # the client gets it with the body; timed as a stream would be (vLLM's way)
            _accumulate(choices[i], out, _work_of(works, i).prompt_only)
        rm.succeeded(c.finish_reason for c in choices)
    except ValueError as e:
        raise bad_request(e) from None
    except TimeoutError as e:
        raise APIError(504, str(e), "Timeout") from None
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - an OpenAI error object, and a status the metrics can count
        raise APIError(status_of(e), str(e) or type(e).__name__, type(e).__name__) from e
    finally:
        rm.close()  # a failure is counted by the APIError handler
    return {
        "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": now(),
        "model": gw.config.model_name,
        "choices": [_final_choice(gw, kind, c, _work_of(works, c.index)) for c in choices],
        "usage": _usage(works, choices),
    }


def _accumulate(choice: _Choice, out: RequestOutput, prompt_only: bool = False) -> None:
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
    choice.cached_tokens = out.num_cached_tokens


def _scored(work: Work, choice: _Choice, token_ids: list[int],
            entries: list[dict[int, float]]) -> tuple[list[int], list[dict[int, float] | None]]:
    """The tokens and logprob entries to report: with echo + logprobs, the prompt's first."""
    if work.params.prompt_logprobs is None:
        return token_ids, list(entries)
    prompt = choice.prompt_logprobs or [None] * len(work.prompt_ids)
    return work.prompt_ids + token_ids, prompt + list(entries)


def _final_choice(gw: Gateway, kind: Kind, c: _Choice, work: Work) -> dict[str, Any]:
    logprobs = _logprobs(gw, kind, *_scored(work, c, c.token_ids, c.logprobs)) if work.params.logprobs is not None else None
    if kind == "chat":
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs, "finish_reason": c.finish_reason}
    return {"index": c.index, "text": (work.echo or "") + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def _logprobs(gw: Gateway, kind: Kind, token_ids: list[int], entries: list[dict[int, float] | None]) -> dict[str, Any]:
    if kind == "chat":
        content = []
        for tok, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            content.append({"token": gw.token_str(tok), "logprob": entry.get(tok, 0.0), "bytes": None,
                            "top_logprobs": [{"token": gw.token_str(t), "logprob": lp, "bytes": None} for t, lp in top]})
        return {"content": content}
    return {  # None entries: the first prompt token (echo), which nothing predicts
        "tokens": [gw.token_str(t) for t in token_ids],
        "token_logprobs": [None if e is None else e.get(t) for t, e in zip(token_ids, entries)],
        "top_logprobs": [None if e is None else {gw.token_str(t): lp for t, lp in e.items()} for e in entries],
        "text_offset": [],
    }


async def _sse(gw: Gateway, kind: Kind, rid: str, works: list[Work], include_usage: bool,
               rm: RequestMetrics) -> AsyncIterator[str]:
    created, obj = now(), ("chat.completion.chunk" if kind == "chat" else "text_completion")
    choices = _choices(works)
    want_logprobs = works[0].params.logprobs is not None

    def chunk(payload_choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": gw.config.model_name,
                "choices": payload_choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    rm.admitted(sum(len(w.prompt_ids) for w in works))
    try:
        if kind == "chat":
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for c in choices])
        async for i, out in gw.run(rid, works):
            c, work, ch = out.outputs[0], _work_of(works, i), choices[i]
            head, ch.started = not ch.started, True
            scored = len(ch.prompt_logprobs or [])
            _accumulate(ch, out, work.prompt_only)
            rm.output(out)
            text, ids, entries = ("", [], []) if work.prompt_only else (c.text, c.token_ids, c.logprobs or [])
            if head:  # echo: the prompt goes before the choice's first text
                text = (work.echo or "") + text
            if work.params.prompt_logprobs is not None and out.prompt_logprobs:  # and its logprobs, as they come
                new = out.prompt_logprobs
                ids, entries = work.prompt_ids[scored : scored + len(new)] + ids, list(new) + entries
            lp = _logprobs(gw, kind, ids, entries) if want_logprobs else None
            finish = ch.finish_reason if c.finish_reason is not None else None
            if kind == "chat":
                yield chunk([{"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": finish}])
            else:
                yield chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}])
        rm.succeeded(c.finish_reason for c in choices)
        if include_usage:
            yield chunk([], usage=_usage(works, choices))
    except (asyncio.CancelledError, GeneratorExit):
        rm.failed(499)  # the client went away mid-stream (after success it is already closed)
        raise
    except ValueError as e:
        rm.failed(400)
        yield f"data: {json.dumps(error_body(str(e), 'BadRequestError', 400))}\n\n"
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        code = status_of(e)
        rm.failed(code)
        yield f"data: {json.dumps(error_body(str(e) or type(e).__name__, type(e).__name__, code))}\n\n"
    finally:
        rm.close()
    yield "data: [DONE]\n\n"
