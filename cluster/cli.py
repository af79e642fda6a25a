"""`pdserve` command line: the one place that reads flags.

Engine and serving flags (defined in cluster/cli_flags.py) have no defaults: a
flag given is a setting (`--max-model-len 2048` is `max_model_len: 2048`, as in a
Serve YAML), and
cluster/serve_config.py turns settings into configs, defaults and checks
included, the same way for both. Subcommands import what they need lazily so
`pdserve --help` stays fast and the offline commands never import Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster import cli_flags as flags

if TYPE_CHECKING:
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.transfer.auth import ClusterSecret


def settings_from_flags(a: argparse.Namespace, serving: bool = False) -> dict[str, object]:
    """The settings the command line gave (flags left out are absent). With no
    --model, the default model (SmolLM2-135M-Instruct, served under that name), or
    the tiny one when it cannot be fetched. A model to convert (a GGUF file) is
    converted here, once, with progress, before any worker starts."""
    from pdserve.cluster.serve_config import ENGINE_SETTINGS, SERVE_SETTINGS
    from pdserve.workers.model.resolve import TINY, resolve_model

    settings = {k: v for k, v in vars(a).items() if k in ENGINE_SETTINGS or k in SERVE_SETTINGS}
    if (spec := getattr(a, "speculative_config", None)) is not None:  # vLLM's: pdserve's own flags win
        from pdserve.workers.spec.vllm_config import speculative_settings

        settings = speculative_settings(spec) | settings
    if "model" not in settings:
        from pdserve.workers.model.default_model import SMOLLM2, default_model

        fetched = default_model(progress=True)
        settings["model"] = str(fetched) if fetched is not None else TINY
        if serving and fetched is not None:
            settings.setdefault("served_model_name", (SMOLLM2.name,))
    model = str(settings["model"])
    # A path that is not there: the engine's error says so. A blank one: the config's (Path("") is the
    # working directory, whose GGUF file was converted).
    if model == TINY or (model.strip() and Path(model).expanduser().exists()):
        resolve_model(model, progress=True)
    return settings


def _cmd_generate(a: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams
    from pdserve.cluster.serve_config import engine_config

    # The sampling flags first: a bad one was refused only once the model had loaded (and
    # compiled, its tensor-parallel ranks started and never closed).
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=getattr(a, "seed", None), stop=a.stop or None, ignore_eos=a.ignore_eos,
                            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                            repetition_penalty=a.repetition_penalty)
    llm = LLM.from_config(engine_config(settings_from_flags(a), progress=True))
    start = time.perf_counter()
    try:
        # --chat: through `chat`, which encodes the template's text without the tokenizer's
        # special tokens (the template writes its own: a BOS added again was a second one).
        outs = (llm.chat([[{"role": "user", "content": p}] for p in a.prompts], params) if a.chat
                else llm.generate(list(a.prompts), params))
    finally:
        llm.close()  # its tensor-parallel ranks, if any
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
    from pdserve.cluster import port_lock, serve_app
    from pdserve.cluster.shutdown import run_until_stopped, serve_in_own_group

    # What can be refused is refused here, before the fork (exit 2): a setting, a key, a port in use.
    cfg = _serve_config(a)
    _check_against_model(cfg)
    if serve_app.starts_local_ray():
        cfg = serve_app.settle_haproxy_ports(cfg)  # (the driver's `run` finds them free then)
    serve_app.preflight(cfg)
    # Ray starts in a process group of the driver's own: SIGTERM/SIGINT to this process or its
    # group is a clean stop, exit 0 (cluster/shutdown.py).
    try:
        return serve_in_own_group(lambda: run_until_stopped(cfg))
    finally:
        # The port's lock, taken here before the fork, is this process's too: a caller that goes
        # on (cli.main in a test or a library) kept it after a driver that died unstopped, and
        # every later run on the port was refused until the caller exited.
        port_lock.release(cfg.port)


def _serve_config(a: argparse.Namespace) -> ServeConfig:
    from pdserve.cluster.serve_config import serve_config

    settings = settings_from_flags(a, serving=True)
    for name, env in (("api_key", flags.API_KEY_ENV), ("metrics_api_key", flags.METRICS_API_KEY_ENV)):
        key = _secret(name, getattr(a, name, None), getattr(a, f"{name}_file", None), env)
        if key is not None:
            settings[name] = key
    cfg = serve_config(settings)
    if a.cluster_secret_file is not None:  # else PDSERVE_CLUSTER_SECRET, else made now (ServeConfig)
        cfg = dataclasses.replace(cfg, cluster_secret=_cluster_secret(a.cluster_secret_file))
    return cfg


def _cluster_secret(path: str) -> ClusterSecret:
    """The data plane's key from --cluster-secret-file. A file that is not there (or not a
    file, or too short) was an OSError traceback out of `main`, or an error that did not say
    which flag: a ValueError naming the flag and the path (never the key), as the other key
    files' (`_secret`)."""
    from pdserve.workers.transfer.auth import ClusterSecret

    try:
        return ClusterSecret.from_file(str(Path(path).expanduser()))
    except OSError as e:
        raise ValueError(f"cluster_secret_file: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cluster_secret_file: {path} is not UTF-8 text") from None
    except ValueError as e:  # ClusterSecret's own: too short (its words hold no part of the key)
        raise ValueError(f"cluster_secret_file: {path}: {e}") from None


def _check_against_model(cfg: ServeConfig) -> None:
    """What the model's config.json allows, checked here when the model is on this machine:
    `max_model_len` within its positions, each pool's tensor-parallel size dividing its heads.
    The workers found them only once Ray, Serve and their own processes were up, and a pool's
    size (`--prefill-tp 3`) was named as `tensor_parallel_size`, a flag not given. A path this
    machine has not is left to the workers of a cluster it joins (their nodes may have it), and
    refused where they would run here, on the local Ray it starts."""
    from pdserve.cluster.serve_app import starts_local_ray
    from pdserve.cluster.serve_config import ServingMode
    from pdserve.workers.engine_setup import tokenizer_source
    from pdserve.workers.model.resolve import TINY, resolve_model

    if starts_local_ray() and cfg.engine.tokenizer is not None:
        tokenizer_source(cfg.engine.tokenizer, "")  # a missing directory, refused before anything starts
    if cfg.model != TINY and not Path(cfg.model).expanduser().exists():
        if starts_local_ray():  # else Ray, Serve and every worker started to say so 20-odd s later
            raise ValueError(f"model: {cfg.model} does not exist")
        return
    from pdserve.workers.engine_setup import resolve_max_model_len
    from pdserve.workers.model.config import ModelConfig
    from pdserve.workers.model.tensor_parallel import check_shardable

    model = ModelConfig.from_pretrained(resolve_model(cfg.model))  # converted already (settings_from_flags)
    resolve_max_model_len(cfg.engine.max_model_len, model)
    pools = ("prefill", "decode") if cfg.mode is ServingMode.DISAGGREGATED else ("worker",)
    for pool in pools:
        own = {"prefill": cfg.prefill_tp, "decode": cfg.decode_tp}.get(pool)
        try:
            check_shardable(model, cfg.pool_tp(pool))
        except ValueError as e:
            if own is None:
                raise
            raise ValueError(str(e).replace("tensor_parallel_size:", f"{pool}_tp:", 1)) from None


def _secret(name: str, given: str | None, path: str | None, env: str) -> str | None:
    """A key from its flag, its file (first line, whitespace stripped) or its
    environment variable, in that order; ValueError naming the flag, never the key."""
    if given is not None and path is not None:
        raise ValueError(f"{name}: give --{name.replace('_', '-')} or --{name.replace('_', '-')}-file, not both")
    if path is not None:
        try:
            key = Path(path).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}_file: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if not key:
            raise ValueError(f"{name}_file: {path} is empty")
        return key
    if given is not None:
        return given
    return os.environ.get(env, "").strip() or None


def _cmd_bench(a: argparse.Namespace) -> int:
    from pdserve.cluster.bench.cli import run

    return run(a)


def _cmd_profile(a: argparse.Namespace) -> int:
    from pdserve.cluster.planner.profile_cli import run

    return run(a)


def _cmd_plan(a: argparse.Namespace) -> int:
    from pdserve.cluster.planner.plan_cli import run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with the engine (no server)")
    flags.generate_arguments(gen)
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="start workers on Ray and the OpenAI-compatible HTTP API")
    flags.serve_arguments(srv)
    srv.set_defaults(func=_cmd_serve)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF-format model with its own BPE tokenizer")
    flags.tiny_model_arguments(tiny)
    tiny.set_defaults(func=_cmd_make_tiny_model)

    pair = sub.add_parser("make-tiny-pair",
                          help="train a tiny target and a 1-layer draft (speculative decoding) on CPU",
                          description="Train the default tiny model and a 1-layer draft distilled from it on the "
                                      "stdlib corpus; write OUT_DIR/target, OUT_DIR/draft and OUT_DIR/quality.json.")
    flags.tiny_pair_arguments(pair)
    pair.set_defaults(func=_cmd_make_tiny_pair)

    from pdserve.cluster.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from pdserve.cluster.bench.cli import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server: TTFT/TPOT/ITL, goodput, plots",
                           description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    from pdserve.cluster.planner.profile_cli import DESCRIPTION as PROFILE_DESCRIPTION
    from pdserve.cluster.planner.profile_cli import add_arguments as add_profile_arguments

    prof = sub.add_parser("profile", help="measure this machine's step and KV handoff costs (a planner's profile)",
                          description=PROFILE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_arguments(prof)
    prof.set_defaults(func=_cmd_profile)

    from pdserve.cluster.planner.plan_cli import DESCRIPTION as PLAN_DESCRIPTION
    from pdserve.cluster.planner.plan_cli import add_arguments as add_plan_arguments

    plan = sub.add_parser("plan", help="size the prefill/decode pools from SLOs by simulating a profile",
                          description=PLAN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(plan)
    plan.set_defaults(func=_cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
