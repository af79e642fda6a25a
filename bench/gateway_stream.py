"""CPU per streamed token of the gateway's own code: the OpenAI app (routes, guard, request
counter, SSE chunks, metrics) over a backend that makes no tokens of its own.

Each request's deltas come one token at a time through an asyncio.Queue, as the token
stream hands them on; the ASGI app is called directly (no HTTP server, no socket, no Ray),
with a `send` that drops the bytes. So the figure is what pdserve's Python adds per token
on top of uvicorn, Ray Serve and the token stream, the part a change to cluster/responses.py,
http_guard.py or metrics.py moves. Per-request work (parsing, validation, tokenizing a short
prompt) is spread over the tokens.

    python bench/gateway_stream.py [--requests 320] [--concurrency 16] [--tokens 64] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from quiet_backend import QuietBackend

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams


class _Backend(QuietBackend):
    """`tokens` one-token deltas per request, each awaited from a queue."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        last = self.tokens - 1
        for i in range(self.tokens):
            c = CompletionOutput(0, " tok", [7], finish_reason="length" if i == last else None)
            queue.put_nowait(RequestOutput(request_id, None, prompt, [c], finished=i == last))
        for _ in range(self.tokens):
            out = await queue.get()
            await asyncio.sleep(0)  # a token comes with a later step: the stream waits for it
            yield out


async def _one(app: Any, body: bytes) -> int:
    """One streamed request through the app; the number of body chunks it sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    delivered = False
    chunks = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client never leaves: the app cancels this when it is done
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        chunks += message["type"] == "http.response.body"

    async with asyncio.timeout(60):
        await app(scope, receive, send)
    return chunks


async def _load(app: Any, body: bytes, requests: int, concurrency: int) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def run() -> int:
        async with gate:
            return await _one(app, body)

    return sum(await asyncio.gather(*[run() for _ in range(requests)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="whose tokenizer the gateway uses")
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions (one more load)")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from pdserve.workers.model.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(a.model, progress=True)))
    app = build_app(Gateway(_Backend(a.tokens), tokenizer, GatewayConfig(model_name="m", max_model_len=4096)))
    body = json.dumps({"model": "m", "prompt": "hello world", "stream": True, "max_tokens": a.tokens,
                       "ignore_eos": True}).encode()
    asyncio.run(_load(app, body, 2 * a.concurrency, a.concurrency))  # warm-up
    # As a Serve replica does at the end of its startup (RAY_SERVE_FREEZE_GC_ON_STARTUP): without
    # it the collector's full passes over the ~450k startup objects (~190 ms each) were a fifth
    # of this process's CPU, which no replica pays.
    gc.collect()
    gc.freeze()
    per_chunk: list[float] = []
    for i in range(a.repeats):
        t0 = time.process_time()
        chunks = asyncio.run(_load(app, body, a.requests, a.concurrency))
        per_chunk.append((time.process_time() - t0) / chunks * 1e6)
        print(f"[gateway-stream] run {i + 1}/{a.repeats}: {per_chunk[-1]:.1f} us", file=sys.stderr, flush=True)
    print(f"# gateway streaming path, in process: {a.requests} requests x {a.tokens} tokens, concurrency "
          f"{a.concurrency}\ncommand: python {' '.join(sys.argv)}\n")
    print("| runs (us CPU per chunk) | median |\n|---|---:|")
    print(f"| {', '.join(f'{x:.1f}' for x in per_chunk)} | {statistics.median(per_chunk):.1f} |")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(_load(app, body, a.requests, a.concurrency))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
