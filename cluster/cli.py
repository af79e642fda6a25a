"""`pdserve` command line: the one place that reads flags.

Subcommands import what they need lazily so `pdserve --help` stays fast and
the offline commands never import Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides the memory budget)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: ngram = prompt lookup (drafts copied from earlier in the sequence); "
                        "draft = a small model's drafts (--draft-model)")
    p.add_argument("--draft-model", default=None, help="HF-format directory of the draft model (same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="most drafts verified per step")


def _engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    return dict(
        dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, block_size=a.block_size,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, num_kv_blocks=a.num_kv_blocks,
        attention_backend=a.attention_backend, enable_prefix_caching=not a.no_prefix_caching, progress=True,
        speculative=a.speculative, num_speculative_tokens=a.num_speculative_tokens, draft_model=a.draft_model,
    )


def _cmd_generate(a: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(model=a.model, **_engine_kwargs(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop or None, ignore_eos=a.ignore_eos,
                            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                            repetition_penalty=a.repetition_penalty)
    prompts = list(a.prompts)
    if a.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(a.prompts, outs):
        c = out.outputs[0]
        print(f"--- prompt: {prompt!r}\n{c.text}\n--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[pdserve] {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def _cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from pdserve.workers.tiny.builder import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        arch=a.arch, num_layers=a.layers, hidden_size=a.hidden_size, num_heads=a.heads,
        num_kv_heads=a.kv_heads if a.kv_heads is not None else a.heads, intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size, seed=a.seed, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings,
    )
    make_tiny_model(a.out_dir, spec, progress=True)
    return 0


def _cmd_make_tiny_pair(a: argparse.Namespace) -> int:
    from pdserve.workers.tiny.train import make_tiny_pair, pair_dir, pair_spec

    spec = pair_spec(seed=a.seed) if a.minutes is None else pair_spec(minutes=a.minutes, seed=a.seed)
    if a.out_dir:
        out = make_tiny_pair(a.out_dir, spec, progress=True, threads=a.threads)
    else:
        out = pair_dir(spec, progress=True, threads=a.threads)
    print(out)
    return 0


def _cmd_serve(a: argparse.Namespace) -> int:
    from pdserve.cluster.serve_app import ServeConfig, run

    model = a.model
    if model is None:
        from pdserve.workers.tiny.builder import default_model_dir

        model = str(default_model_dir(progress=True))
    engine_args: dict[str, object] = {"dtype": a.dtype, "device": a.device, "max_num_seqs": a.max_num_seqs,
                                      "max_num_batched_tokens": a.max_num_batched_tokens,
                                      "num_kv_blocks": a.num_kv_blocks, "attention_backend": a.attention_backend,
                                      "enable_prefix_caching": not a.no_prefix_caching,
                                      "speculative": a.speculative, "num_speculative_tokens": a.num_speculative_tokens,
                                      "draft_model": a.draft_model}
    cfg = ServeConfig(model=model, mode=a.mode, num_prefill=a.prefill, num_decode=a.decode, transport=a.transport, ingress=a.ingress,
                      router_policy=a.router_policy,
                      host=a.host, port=a.port,
                      api_key=a.api_key, max_model_len=a.max_model_len, block_size=a.block_size,
                      engine_args=engine_args)
    run(cfg)
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from pdserve.cluster.bench.cli import run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with the engine (no server)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating prompt and output tokens")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="start workers on Ray and the OpenAI-compatible HTTP API")
    srv.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    srv.add_argument("--prefill", type=int, default=1, help="prefill workers (colocated: total workers = prefill + decode)")
    srv.add_argument("--decode", type=int, default=1, help="decode workers")
    srv.add_argument("--transport", default="zmq", choices=["zmq", "nccl"])
    srv.add_argument("--ingress", default="haproxy", choices=["haproxy", "proxy"],
                     help="Ray Serve's HAProxy ingress (fast) or its Python proxy actor (local Ray only: "
                          "a running cluster keeps the ingress it was started with)")
    srv.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "round_robin"],
                     help="how the gateway picks prefill workers (round_robin: for comparison)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None)
    _add_engine_args(srv)
    srv.set_defaults(func=_cmd_serve)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF-format model with its own BPE tokenizer")
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral"])
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--hidden-size", type=int, default=256)
    tiny.add_argument("--heads", type=int, default=8)
    tiny.add_argument("--kv-heads", type=int, default=2, help="KV heads (GQA); equal to --heads for MHA")
    tiny.add_argument("--intermediate-size", type=int, default=None)
    tiny.add_argument("--vocab-size", type=int, default=4096)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--rope-scaling", default=None, choices=["llama3"])
    tiny.add_argument("--max-position-embeddings", type=int, default=2048)
    tiny.set_defaults(func=_cmd_make_tiny_model)

    pair = sub.add_parser("make-tiny-pair", help="train a tiny target and a 1-layer draft (speculative decoding) on CPU",
                          description="Train the default tiny model and a 1-layer draft distilled from it on the "
                                      "stdlib corpus; write OUT_DIR/target, OUT_DIR/draft and OUT_DIR/quality.json.")
    pair.add_argument("out_dir", nargs="?", default=None,
                      help="where to write the pair (default: the cache, trained once per spec; prints the path)")
    pair.add_argument("--minutes", type=float, default=None,
                      help="training budget (default 4.5), as step counts that take about this long on a 2-core "
                           "AMD EPYC: the steps, not the clock, decide the weights")
    pair.add_argument("--seed", type=int, default=0)
    pair.add_argument("--threads", type=int, default=None,
                      help="torch threads while training (default: every core; on a machine other jobs keep busy, "
                           "fewer threads than cores can be several times faster)")
    pair.set_defaults(func=_cmd_make_tiny_pair)

    from pdserve.cluster.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from pdserve.cluster.bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server: TTFT/TPOT/ITL, goodput, plots",
                           description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
