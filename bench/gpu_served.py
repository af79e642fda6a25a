#!/usr/bin/env python3
"""pdserve served over HTTP on one device, without Ray (issue 49, item 3; a step of
bench/gpu_check.sh). Ray cannot be installed on a lent GPU machine, so the cluster runs
in this process (cluster/in_process.py): the real gateway (uvicorn, the OpenAI API) in
front of the disaggregated backend, one prefill and one decode worker service sharing
the card, KV over ZeroMQ between them on loopback.

1. correctness: the tiny model in float32, greedy, `--check-prompts` chat requests
   through HTTP: every answer equals the offline engine's text;
2. speed: the Llama-3-8B shape (random bf16 weights made on the device, as in
   bench/gpu_e2e.py), `--streams` concurrent streamed completions of `--new-tokens`
   tokens (ignore_eos) after `--prompt-len`-token prompts: served output tok/s, TTFT and
   TPOT medians, and the same requests through the offline engine at the same batch
   (its tok/s: the engine's own rate); served / engine is issue 49's bar (>= 0.85x).

    python3 bench/gpu_served.py [--dry-run] [--streams 64] [--new-tokens 128] [--prompt-len 256]

--dry-run: the CPU, a two-layer model of the same kind in float32 and a few streams:
checks this script's logic (CI runs it through gpu_check.sh --dry-run), says nothing
about speed. Adds its results to $OUT/e2e.json ("served") when OUT is set; exits 1 when
a check fails or a section raised. Needs pyzmq, fastapi, uvicorn and pydantic (carried
as wheels to a lent machine whose image lacks them), not Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import http.client
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the lent GPU machine has pdserve's tree, not the package
sys.path.insert(0, str(ROOT / "bench"))

from gpu_e2e import DRY_LLAMA, LLAMA3_8B, random_weights, shape_dir  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cluster.actors import DecodeService, PrefillService  # noqa: E402
from pdserve.cluster.disagg_backend import DisaggregatedBackend  # noqa: E402
from pdserve.cluster.gateway import Gateway, GatewayConfig  # noqa: E402
from pdserve.cluster.in_process import LocalActor, serve_gateway  # noqa: E402
from pdserve.cluster.router import Router  # noqa: E402
from pdserve.cluster.router.policy import RouterConfig  # noqa: E402
from pdserve.workers.config import EngineConfig  # noqa: E402
from pdserve.workers.tiny.builder import default_model_dir  # noqa: E402

RESULTS: dict[str, Any] = {"checks": [], "errors": []}
CHECK_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Count to five.",
                 "Name three colours.", "What is 2 + 2?", "Say hello in French."]


def log(msg: str) -> None:
    print(f"[gpu_served] {msg}", flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS["checks"].append({"name": name, "ok": ok, "detail": detail})
    log(f"check {name}: {'PASS' if ok else 'FAIL'} {detail}")


class Cluster:
    """One prefill and one decode worker service on the device, the backend over them and
    the gateway served on loopback; `url` once entered."""

    def __init__(self, model: str, tokenizer: str | None, dtype: str, device: str, max_model_len: int,
                 max_num_seqs: int, memory_share: float) -> None:
        self.base = EngineConfig(model=model, tokenizer=tokenizer, dtype=dtype, device=device,  # type: ignore[arg-type]
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max(2048, max_model_len), enable_prefix_caching=False,
                                 gpu_memory_utilization=memory_share,
                                 num_kv_blocks=None if device == "cuda" else 512)  # a CPU's default is 4 GiB each
        self.memory_share = memory_share
        self.stack = ExitStack()
        self.url = ""

    def __enter__(self) -> Cluster:
        threads = 1 if self.base.device == "cuda" else max(1, (os.cpu_count() or 2) // 2)
        # Two engines share the card: each plans its KV pool from gpu_memory_utilization of the
        # whole card less what is in use when it starts, so the second one's share is counted on
        # top of the first's.
        self.decode = DecodeService(self.base, threads, "127.0.0.1", worker_name="d0")
        self.stack.callback(self.decode.close)  # whatever fails after this, its engine thread stops
        try:
            second = dataclasses.replace(self.base, gpu_memory_utilization=min(1.0, 2 * self.memory_share))
            self.prefill = PrefillService(second, threads, worker_name="p0", kv_host="127.0.0.1")
            self.stack.callback(self.prefill.close)
            router = Router(RouterConfig(local_prefill_threshold_tokens=0), self.decode.engine.config.block_size)
            backend = DisaggregatedBackend({"p0": LocalActor(self.prefill)}, {"d0": LocalActor(self.decode)},
                                           router, poll_s=0.01)
            gw = Gateway(backend, self.prefill.engine.tokenizer,
                         GatewayConfig(model_name="m", max_model_len=self.base.max_model_len, max_in_flight=4096,
                                       request_timeout_s=600.0))
            self.url = self.stack.enter_context(serve_gateway(gw, log_level="warning"))
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()  # the gateway, then the prefill and the decode service
        del self.prefill, self.decode  # their weights and KV pools go back before the next engine plans
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def post(url: str, path: str, body: dict[str, Any], timeout_s: float = 600.0) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:500]!r}")
    return resp


def stream(url: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One streamed completion: token count (usage), time to the first token, the whole time."""
    body = {"model": "m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    resp = post(url, "/v1/completions", body)
    first: float | None = None
    tokens = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        if first is None and event.get("choices") and event["choices"][0].get("text"):
            first = time.perf_counter()
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = (first or end) - start
    return {"tokens": tokens, "ttft": ttft, "tpot": (end - start - ttft) / max(1, tokens - 1), "end": end,
            "start": start}


def correctness(args: argparse.Namespace, device: str) -> None:
    """The tiny model, float32, greedy: served chat answers equal the offline engine's."""
    model = str(default_model_dir(progress=False))
    params = SamplingParams(temperature=0.0, max_tokens=32)
    offline = LLM(model, dtype="float32", device=device, max_model_len=512, enable_prefix_caching=False,
                  gpu_memory_utilization=0.2, num_kv_blocks=None if device == "cuda" else 512, progress=False)
    tok = offline.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in CHECK_PROMPTS[: args.check_prompts]]
    want = [o.outputs[0].text for o in offline.generate(prompts, params)]
    del offline
    gc.collect()
    with Cluster(model, None, "float32", device, 512, 16, 0.2) as c:
        got = []
        for p in CHECK_PROMPTS[: args.check_prompts]:
            body = {"model": "m", "messages": [{"role": "user", "content": p}], "max_tokens": 32, "temperature": 0.0}
            got.append(json.loads(post(c.url, "/v1/chat/completions", body).read())["choices"][0]["message"]
                       ["content"])
    same = sum(g == w for g, w in zip(got, want))
    check("served greedy = offline (tiny, float32)", same == len(want), f"{same}/{len(want)} answers equal")
    RESULTS["correctness"] = {"equal": same, "of": len(want), "example": got[0][:80]}


def speed(args: argparse.Namespace, device: str) -> None:
    shape = DRY_LLAMA if args.dry_run else LLAMA3_8B
    model_dir = shape_dir(shape)
    tokenizer = str(default_model_dir(progress=False))
    max_len = args.prompt_len + args.new_tokens + 16
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, shape["vocab_size"] - 10, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.streams)]
    with random_weights():
        with Cluster(str(model_dir), tokenizer, shape["torch_dtype"], device, max_len, args.streams, 0.4) as c:
            log(f"served: {args.streams} streams x {args.new_tokens} tokens after {args.prompt_len}-token prompts")
            stream(c.url, prompts[0], 8)  # warm-up: first calls on new shapes
            with ThreadPoolExecutor(args.streams) as pool:
                runs = list(pool.map(lambda p: stream(c.url, p, args.new_tokens), prompts))
        wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
        served_tps = sum(r["tokens"] for r in runs) / wall
        check("every stream got its tokens", all(r["tokens"] == args.new_tokens for r in runs),
              f"{sum(r['tokens'] == args.new_tokens for r in runs)}/{len(runs)} streams")
        llm = LLM(str(model_dir), tokenizer=tokenizer, dtype=shape["torch_dtype"], device=device, max_model_len=max_len,
                  max_num_seqs=args.streams, enable_prefix_caching=False, gpu_memory_utilization=0.4,
                  num_kv_blocks=None if device == "cuda" else 512, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    engine_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    RESULTS["speed"] = {
        "streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "served_tok_s": served_tps, "engine_tok_s": engine_tps, "ratio": served_tps / engine_tps,
        "ttft_median_ms": statistics.median(r["ttft"] for r in runs) * 1e3,
        "tpot_median_ms": statistics.median(r["tpot"] for r in runs) * 1e3,
    }
    s = RESULTS["speed"]
    log(f"served {served_tps:.0f} tok/s, engine {engine_tps:.0f} tok/s: {s['ratio']:.2f}x; "
        f"TTFT {s['ttft_median_ms']:.0f} ms, TPOT {s['tpot_median_ms']:.1f} ms (medians)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the CPU, a two-layer model, a few streams")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams (64; dry run 4)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per stream (128; dry run 8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (256; dry run 16)")
    ap.add_argument("--check-prompts", type=int, default=None, help="correctness prompts (6; dry run 2)")
    ap.add_argument("--only", default="correctness,speed")
    args = ap.parse_args()
    dry = args.dry_run
    args.streams = args.streams or (4 if dry else 64)
    args.new_tokens = args.new_tokens or (8 if dry else 128)
    args.prompt_len = args.prompt_len or (16 if dry else 256)
    args.check_prompts = args.check_prompts or (2 if dry else len(CHECK_PROMPTS))
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    missing = [m for m in ("zmq", "fastapi", "uvicorn", "pydantic") if importlib.util.find_spec(m) is None]
    if missing:
        RESULTS["errors"].append({"section": "setup", "traceback": f"missing: {', '.join(missing)}: carry their "
                                  "wheels (the device tool's README: a package missing there)"})
        args.only = ""
    for name, fn in (("correctness", correctness), ("speed", speed)):
        if name in args.only.split(","):
            log(f"== {name}")
            try:
                fn(args, device)
            except Exception:  # noqa: BLE001 - one section's failure is reported, the other still runs
                RESULTS["errors"].append({"section": name, "traceback": traceback.format_exc()})
                log(f"{name} raised:\n{traceback.format_exc()}")
    if out := os.environ.get("OUT"):
        # Into e2e.json (bench/gpu_e2e.py's, step 3): the device tool brings back 8 files, all taken.
        path = Path(out) / "e2e.json"
        Path(out).mkdir(parents=True, exist_ok=True)
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged["served"] = RESULTS
        path.write_text(json.dumps(merged, indent=1, default=str))
    return 1 if RESULTS["errors"] or not all(c["ok"] for c in RESULTS["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
