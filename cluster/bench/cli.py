"""The flags of `pdserve bench` (cluster/cli.py mounts them) -> a `BenchConfig` -> a `Session`."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import BenchConfig

DESCRIPTION = """\
Load-test an OpenAI-compatible server (pdserve or any other): send a workload at
Poisson/gamma arrivals, measure TTFT, TPOT, ITL and E2E per request from the
stream, and report percentiles, throughput, goodput and SLO attainment.
Example:
  pdserve bench --base-url http://127.0.0.1:8000/v1 --input-len 1024 --output-len 128 \\
      --num-requests 200 --request-rate 4 --goodput ttft:500 tpot:50 \\
      --result-json out/bench.json --plot-dir out/plots
"""


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return v


def _token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload flags (what each request is); `pdserve plan` takes the same ones."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random", choices=["random", "shared-prefix", "trace"])
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default 200; trace: every row)")
    w.add_argument("--input-len", type=int, default=1024, help="prompt tokens (shared-prefix: prefix included)")
    w.add_argument("--output-len", type=int, default=128, help="output tokens asked for (max_tokens)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)] (default 0: exact)")
    w.add_argument("--num-prefix-groups", type=int, default=8, help="shared-prefix: distinct prefixes")
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens every request of a group shares")
    w.add_argument("--trace", default=None, help="trace: JSONL of {timestamp, input_length, output_length, hash_ids?}")
    w.add_argument("--trace-time-unit", default="ms", choices=["ms", "s"],
                   help="unit of the trace's timestamps (default ms, as in Mooncake traces)")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="replay the trace this many times faster")
    w.add_argument("--block-size", type=int, default=512, help="trace: tokens per hash id (Mooncake: 512)")
    w.add_argument("--token-id-range", type=_token_range, default=(16, 4096), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI) (default 16:4096): inside the vocabulary, "
                        "clear of special tokens")
    w.add_argument("--tokenizer", default=None,
                   help="HF tokenizer path: send text that re-tokenizes to exactly the lengths "
                        "(needed for --endpoint chat) instead of token ids")


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the API root, ending in /v1")
    s.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    s.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take in all, stream included (default 600)")

    add_workload_arguments(p)

    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=_rate, default=math.inf,
                    help="mean requests/s (default inf: all at once); a timestamped trace keeps its own timing")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    ld.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (client side)")
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="send ignore_eos so every request yields exactly --output-len tokens (default on)")
    ld.add_argument("--temperature", type=float, default=0.0)

    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 [e2e:MS]: goodput = requests/s meeting all of them")
    o.add_argument("--sweep", default=None, metavar="R1,R2,...",
                   help="run at each rate; report the attainment curve and the highest rate with >= 90%% "
                        "attainment (needs --goodput)")
    o.add_argument("--result-json", default=None, help="write config, per-request records, summaries, sweep")
    o.add_argument("--plot-dir", default=None, help="write TTFT/TPOT/ITL CDFs (and attainment vs rate) as PNG")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar on stderr")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    from .client import Endpoint
    from .config import BenchConfig
    from .metrics import SLO
    from .sweep import parse_rates
    from .workloads import TimeUnit, TokenRange, WorkloadKind

    return BenchConfig(
        base_url=a.base_url, model=a.model, endpoint=Endpoint(a.endpoint), api_key=a.api_key,
        workload=WorkloadKind(a.workload), num_requests=a.num_requests, input_len=a.input_len,
        output_len=a.output_len, range_ratio=a.range_ratio, num_prefix_groups=a.num_prefix_groups,
        prefix_len=a.prefix_len, trace=a.trace, trace_time_unit=TimeUnit(a.trace_time_unit),
        trace_speedup=a.trace_speedup, block_size=a.block_size, token_ids=TokenRange(*a.token_id_range),
        tokenizer=a.tokenizer, request_rate=a.request_rate, burstiness=a.burstiness,
        max_concurrency=a.max_concurrency, seed=a.seed, ignore_eos=a.ignore_eos, temperature=a.temperature,
        request_timeout=a.request_timeout, slo=SLO.parse(a.goodput) if a.goodput else None,
        sweep=tuple(parse_rates(a.sweep)) if a.sweep else None, result_json=a.result_json, plot_dir=a.plot_dir,
        progress=a.progress,
    )


def run(a: argparse.Namespace) -> int:
    from .driver import Session

    return Session(config_from_args(a)).run()
