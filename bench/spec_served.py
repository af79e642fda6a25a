"""n-gram speculation through the server at batch 1 (issue 49's bar: >= 1.5x on SmolLM2 on a
CPU, greedy identical): `pdserve serve` without and then with `--speculative ngram`, the
same streamed chat requests one at a time, a repetitive code prompt (the model is asked to
print a piece of code back with one name changed: what it writes is mostly in the prompt).

Per request: decode tokens/s = (completion tokens - 1) / (last token - first token), so the
prefill and the first token (not speculated) cancel out; medians over `--requests` after one
warm-up request (whose first verify steps also teach the engine the price of a draft). Also
whether each request's text equals the plain server's: in float32 it must; in bfloat16 too
since the compiled forward has one graph for every row count (docs/speculative.md), but for
oneDNN's one-row GEMM, which still rounds a few layers differently from 2-16 rows.

    python bench/spec_served.py --model DIR [--requests 5] [--max-tokens 200] [-- --dtype float32 ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import cpu_name  # bench/ is on sys.path when run as a script
from served import PDSERVE, start, stop, wait_healthy

CODE = '''def add_item(self, item):
    self.items.append(item)
    self.count = self.count + 1
    return self.count

def remove_item(self, item):
    self.items.remove(item)
    self.count = self.count - 1
    return self.count
'''
ASK = "Rename `items` to `things` in this code and print the whole code:\n\n" + CODE


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: pdserve serve's default model)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per server, after one warm-up")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("serve_args", nargs="*", help="after --: flags for both servers (e.g. --dtype float32)")
    a = p.parse_args()
    if a.requests < 1:
        p.error("--requests: must be >= 1")
    return a


def one(port: int, model: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request: its text, completion tokens and decode tokens/s."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": model, "messages": [{"role": "user", "content": ASK}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    text, tokens = "", 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
            text += event["choices"][0]["delta"]["content"]
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    if first is None or last is None or last <= first:
        raise SystemExit(f"a request streamed too little to time: {tokens} tokens, {text!r}")
    return {"text": text, "tokens": tokens, "decode_tok_s": (tokens - 1) / (last - first)}


def serve_and_measure(a: argparse.Namespace, extra: list[str], log: Path) -> list[dict[str, Any]]:
    cmd = [PDSERVE, "serve", "--port", str(a.port), *(["--model", a.model] if a.model else []), *a.serve_args,
           *extra]
    print(f"[spec-served] {' '.join(cmd[1:])} ...", file=sys.stderr, flush=True)
    server = start(cmd, log)
    try:
        url = f"http://127.0.0.1:{a.port}"
        wait_healthy(url, server, log)
        conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=30)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        one(a.port, model, a.max_tokens)  # warm-up
        runs = []
        for i in range(a.requests):
            runs.append(one(a.port, model, a.max_tokens))
            print(f"[spec-served]   request {i + 1}/{a.requests}: {runs[-1]['tokens']} tokens, "
                  f"{runs[-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        return runs
    finally:
        stop(server)


def main() -> int:
    a = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="spec-served-"))
    plain = serve_and_measure(a, [], tmp / "plain.log")
    ngram = serve_and_measure(a, ["--speculative", "ngram"], tmp / "ngram.log")
    p = statistics.median(r["decode_tok_s"] for r in plain)
    q = statistics.median(r["decode_tok_s"] for r in ngram)
    same = sum(r["text"] == plain[0]["text"] for r in ngram)
    print(f"# python bench/spec_served.py {' '.join(sys.argv[1:])}; {cpu_name()}")
    print(f"batch 1, greedy, {a.requests} requests after a warm-up; decode tok/s from the first token to the last\n")
    print("| server | completion tokens | decode tok/s (requests) | median |")
    print("|---|---|---|---:|")
    for name, runs, median in (("plain", plain, p), ("--speculative ngram", ngram, q)):
        listed = ", ".join(f"{r['decode_tok_s']:.1f}" for r in runs)
        print(f"| {name} | {sorted({r['tokens'] for r in runs})} | {listed} | {median:.1f} |")
    print(f"\nngram / plain: **{q / p:.2f}x**; texts equal to the plain server's: {same}/{len(ngram)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
