"""Short requests' time to first token while long prompts tokenize, through the gateway:
the old gateway (one tokenizer thread, first come first served, no length bound before
tokenizing) beside the current one (a character bound before tokenizing, a pool of two
lanes sized to the cores), in one run.

Each mode gets the same load: `--long` prompts of `--long-mib` MiB (what
--max-body-bytes lets in: each is refused either way, the old gateway after tokenizing
it) and `--near` prompts just under the current gateway's character bound (tokenized
in both modes), all sent at once, then `--short` short streamed requests one every
`--interval-ms`. The ASGI app is called directly (no HTTP server, no Ray) over a backend
that answers each request with one token at once, so a short request's TTFT is the
gateway's own wait: parsing, admission, tokenizing, and whatever it queues behind.

It also checks that a fast tokenizer's `encode` releases the GIL (what makes threads
worth it): the longest pause of a 1 ms ticker while a thread encodes a near-bound prompt.

    python bench/tokenizer_starvation.py [--model tiny] [--max-model-len 8192] [--long 2] [--near 4] [--short 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from machine import cpu_name
from quiet_backend import QuietBackend

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.tokenizer_pool import TokenizerPool, available_cores
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she all we one def return import class self value print if else while range").split()


class _Backend(QuietBackend):
    """One token per request, at once."""

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, " tok", [7], finish_reason="length")],
                            finished=True)


def _text(chars: int, seed: int) -> str:
    """English-like words and code, `chars` characters (a tokenizer's ordinary work)."""
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=chars // 4 + 8)
    return " ".join(words)[:chars]


async def _request(app: Any, body: bytes) -> tuple[float, int]:
    """(seconds to the first body chunk, HTTP status) of one request through the app."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    delivered = False
    status, first = 0, 0.0
    t0 = time.perf_counter()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client never leaves: the app cancels this when it is done
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, first
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body") and not first:
            first = time.perf_counter() - t0

    async with asyncio.timeout(900):
        await app(scope, receive, send)
    return first, status


async def _load(app: Any, longs: list[bytes], short: bytes, n_short: int, interval_s: float
                ) -> tuple[list[float], list[tuple[float, int]], list[int]]:
    """The long requests at once, then the short ones one every `interval_s`: the
    short ones' TTFTs, the long ones' (latency, status), the short ones' statuses."""
    long_tasks = [asyncio.ensure_future(_request(app, b)) for b in longs]
    short_tasks = []
    for _ in range(n_short):
        await asyncio.sleep(0)  # the long requests' handlers run first: they came first
        short_tasks.append(asyncio.ensure_future(_request(app, short)))
        await asyncio.sleep(interval_s)
    shorts = await asyncio.gather(*short_tasks)
    return [t for t, _ in shorts], list(await asyncio.gather(*long_tasks)), [s for _, s in shorts]


def _gil_pause(tokenizer: Any, text: str) -> tuple[float, float]:
    """(longest pause of a 1 ms ticker, seconds of encoding) while a thread encodes `text`."""
    done = threading.Event()
    spent = [0.0]

    def work() -> None:
        t0 = time.perf_counter()
        tokenizer.encode(text)
        spent[0] = time.perf_counter() - t0
        done.set()

    last, gap = time.perf_counter(), 0.0
    threading.Thread(target=work).start()
    while not done.wait(0.001):
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return gap, spent[0]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="whose tokenizer the gateway uses")
    p.add_argument("--max-model-len", type=int, default=8192, help="the gateway's context length")
    p.add_argument("--long", type=int, default=2, help="prompts of --long-mib MiB, sent at once")
    p.add_argument("--long-mib", type=float, default=15.0)
    p.add_argument("--near", type=int, default=4, help="prompts just under the character bound, sent at once")
    p.add_argument("--short", type=int, default=40, help="short streamed requests, one every --interval-ms")
    p.add_argument("--interval-ms", type=float, default=50.0)
    a = p.parse_args()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pdserve.workers.model.resolve import resolve_model

    hf_logging.set_verbosity_error()  # "sequence longer than the model's maximum": the point here
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(a.model, progress=True)))
    cfg = GatewayConfig(model_name="m", max_model_len=a.max_model_len)
    modes = {"old: 1 thread, no bound": Gateway(_Backend(), tokenizer, cfg, TokenizerPool(1, 0, inline_chars=0)),
             "new: bound + 2 lanes": Gateway(_Backend(), tokenizer, cfg)}
    old, new = modes.values()
    old.char_bound = None
    bound = new.char_bound
    if bound is None:
        raise SystemExit(f"{a.model}'s tokenizer has no character bound: pick another to compare")
    near_text = _text(bound.max_chars - 16, 1)
    longs = [json.dumps({"model": "m", "prompt": _text(int(a.long_mib * (1 << 20)), 2 + i), "max_tokens": 1,
                         "stream": True}).encode() for i in range(a.long)]
    longs += [json.dumps({"model": "m", "prompt": near_text, "max_tokens": 1, "stream": True}).encode()
              for _ in range(a.near)]
    short = json.dumps({"model": "m", "prompt": "Say hello to the user.", "max_tokens": 1, "stream": True}).encode()
    gap, spent = _gil_pause(tokenizer, near_text)
    print(f"[tokenizer-starvation] encode of {len(near_text)} characters on a thread: {spent * 1e3:.0f} ms, "
          f"longest pause of a 1 ms ticker meanwhile {gap * 1e3:.1f} ms", file=sys.stderr, flush=True)

    rows = []
    for name, gw in modes.items():
        app = build_app(gw)
        t0 = time.perf_counter()
        ttfts, long_results, statuses = asyncio.run(_load(app, longs, short, a.short, a.interval_ms / 1e3))
        wall = time.perf_counter() - t0
        gw.pool.shutdown()
        assert all(s == 200 for s in statuses), statuses
        long_s = [f"{t:.2f} s {s}" for t, s in long_results]
        print(f"[tokenizer-starvation] {name}: {wall:.1f} s; long requests (first byte, status): {long_s}",
              file=sys.stderr, flush=True)
        rows.append((name, statistics.median(ttfts), _pct(ttfts, 0.99), max(ttfts),
                     max(t for t, _ in long_results[:a.long]) if a.long else 0.0))

    print(f"# short requests' TTFT while long prompts tokenize, in process: {a.long} x {a.long_mib:g} MiB + "
          f"{a.near} x {len(near_text)} characters (just under the bound: {bound.chars_per_token} characters a "
          f"token x {a.max_model_len - 1}) at once, then {a.short} short streamed requests every "
          f"{a.interval_ms:g} ms\n"
          f"command: python {' '.join(sys.argv)}\n"
          f"machine: {cpu_name()}, {os.cpu_count()} cores ({available_cores()} usable; short lane "
          f"{new.pool.threads} threads, long lane {new.pool.long_threads}), load average at the end "
          f"{os.getloadavg()[0]:.1f}\n"
          f"encode on a thread releases the GIL: {len(near_text)} characters in {spent * 1e3:.0f} ms, the longest "
          f"pause of a 1 ms ticker meanwhile {gap * 1e3:.1f} ms\n")
    print(f"| gateway | short TTFT median (ms) | p99 (ms) | max (ms) | a {a.long_mib:g} MiB prompt's 400 after (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, med, p99, most, long_400 in rows:
        print(f"| {name} | {med * 1e3:.1f} | {p99 * 1e3:.1f} | {most * 1e3:.1f} | {long_400:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
