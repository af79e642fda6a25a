"""`pdserve plan`: flags -> a `Planner` -> a table (or JSON) of configurations.

The workload flags are `pdserve bench`'s own (bench/cli.add_workload_arguments), read
into a `BenchConfig` by the bench's own `config_from_args`, so a plan and a bench run
with the same flags and seed see the same requests.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from pdserve.cluster.bench.cli import add_workload_arguments

DESCRIPTION = """\
Size the pools from SLOs: simulate every configuration (N colocated, or P prefill +
D decode) on the workload through a profile from `pdserve profile`, and print those
that meet the SLOs at a rate with the fewest workers (--rate), or every split of a
number of workers with its goodput (--gpus). With a profile per tensor-parallel size
(--profile again), the counts are devices and pools of different sizes are compared.
Example:
  pdserve plan --profile profile.json --slo ttft:500 tpot:50 --rate 4 \\
      --input-len 1024 --output-len 128 --num-requests 300
"""


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, action="append",
                   help="a profile JSON written by `pdserve profile`; again for each tensor-parallel size to "
                        "consider (`pdserve profile -tp N`): the counts are then devices, and every split of them "
                        "into pools of these sizes is a candidate")
    p.add_argument("--slo", nargs="+", required=True, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 [e2e:MS] (the syntax of bench's --goodput)")
    q = p.add_mutually_exclusive_group(required=True)
    q.add_argument("--rate", type=_positive(float),
                   help="requests/s to serve: the configurations meeting the SLOs with the fewest workers")
    q.add_argument("--gpus", type=_positive(int), metavar="N",
                   help="workers to use (devices, with profiles of several tensor-parallel sizes): the goodput of "
                        "N colocated and of every P+D = N")
    p.add_argument("--config", default=None, metavar="1P+1D|N",
                   help="with --rate: simulate this one configuration (P+D, or N colocated) and print the "
                        "summary `pdserve bench` prints, for comparing with a measured run")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet every SLO (default 0.9, DistServe's goodput)")
    p.add_argument("--max-workers", type=_positive(int), default=8, help="--rate: the most workers tried (default 8)")
    p.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "round_robin"])
    p.add_argument("--no-colocated", dest="colocated", action="store_false",
                   help="leave colocated configurations out")
    p.add_argument("--max-in-flight", type=_positive(int), default=256,
                   help="the gateway's admission bound, as `pdserve serve --max-in-flight` (default 256)")
    p.add_argument("--dispatch-ms", type=float, default=0.0,
                   help="ms from a request's send to the router (HTTP, tokenizing), added to every TTFT (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e = p.add_argument_group("engine (default: the profile's)")
    e.add_argument("--max-num-seqs", type=_positive(int), default=None)
    e.add_argument("--max-num-batched-tokens", type=_positive(int), default=None)
    e.add_argument("--num-kv-blocks", type=_positive(int), default=None, help="KV blocks per worker")
    e.add_argument("--kv-block-size", type=_positive(int), default=None,
                   help="tokens per KV block (--block-size is the trace's tokens per hash id, as in bench)")
    add_workload_arguments(p)
    ld = p.add_argument_group("load")
    ld.add_argument("--burstiness", type=_positive(float), default=1.0,
                    help="gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    ld.add_argument("--seed", type=int, default=0)


def _bench_config(a: argparse.Namespace) -> Any:
    """The BenchConfig `pdserve bench` would build from the same workload flags."""
    from pdserve.cluster.bench.cli import add_arguments as add_bench_arguments
    from pdserve.cluster.bench.cli import config_from_args

    bench = argparse.ArgumentParser(add_help=False)
    add_bench_arguments(bench)
    ns = bench.parse_args([])
    for key in vars(ns):
        if hasattr(a, key):
            setattr(ns, key, getattr(a, key))
    ns.seed, ns.burstiness, ns.progress = a.seed, a.burstiness, False
    if a.rate is not None:
        ns.request_rate = a.rate
    return config_from_args(ns)


def build_planner(a: argparse.Namespace) -> Any:
    from pdserve.cluster.bench.metrics import SLO
    from pdserve.cluster.planner.planner import Planner
    from pdserve.cluster.planner.sim_workload import Workload
    from pdserve.cluster.planner.simulator import engine_settings
    from pdserve.cluster.router.policy import RoutingPolicy

    profiles = [_load(path) for path in a.profile]
    by_tp: dict[int, Any] = {}
    for path, profile in zip(a.profile, profiles, strict=True):
        size = profile.engine.tensor_parallel_size
        if size in by_tp:
            raise ValueError(f"profile {path}: a second profile of workers of {size} tensor-parallel rank(s); "
                             "give one a size")
        if profile.model.get("path") != profiles[0].model.get("path"):
            raise ValueError(f"profile {path}: of model {profile.model.get('path')!r}, not the first profile's "
                             f"{profiles[0].model.get('path')!r}")
        _warn_fit(profile)
        by_tp[size] = profile
    pools = {size: (p.costs(), engine_settings(
        p, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        num_kv_blocks=a.num_kv_blocks, block_size=a.kv_block_size)) for size, p in by_tp.items()}
    costs, engine = pools[min(pools)]
    workload = Workload.build(_bench_config(a), engine.block_size)
    return Planner(costs, engine, workload, SLO.parse(a.slo), a.attainment, RoutingPolicy(a.router_policy),
                   a.max_in_flight, a.colocated, a.dispatch_ms / 1000, pools)


def _load(path: str) -> Any:
    from pdserve.cluster.planner.profile import Profile

    try:
        return Profile.load(path)
    except FileNotFoundError:
        raise ValueError(f"profile {path}: no such file") from None
    except OSError as e:  # a directory, no permission: a message, as for a missing file
        raise ValueError(f"profile {path}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"profile {path}: {e}") from None


def _warn_fit(profile: Any) -> None:
    """Say on stderr when a profile point is more than 20% off its cost model's fitted shape.
    The simulator follows the measured points (cost_grid.py), so such a point is either the
    hardware's own curve or noise the simulator now repeats: worth a second profile."""
    for kind, (err, where) in profile.costs().fitted.fit_errors(profile).items():
        if abs(err) > 0.2:
            print(f"pdserve plan: warning: the {kind} cost model's fitted shape is {err:+.0%} off the profile at "
                  f"{where}; the simulator follows the measured points there (if that point is noise, profile "
                  "again)", file=sys.stderr)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _header(planner: Any, what: str) -> str:
    slo = " ".join(f"{k} {v * 1000:g} ms" for k, v in planner.slo.as_dict().items())
    return f"pdserve plan: {what}; SLO {slo}; attainment >= {planner.target:.0%}; {len(planner.workload.requests)} " \
           f"requests"


def _unit(planner: Any) -> str:
    """What the counts are: workers, or devices once a pool's workers span several ranks."""
    return "devices" if max(planner.sizes) > 1 else "workers"


def _columns(unit: str) -> str:
    return (f"{'config':<16}{unit:>8}{'attain':>8}  {'TTFT p50':>9}{'p90':>9}{'p99':>9}  "
            f"{'TPOT p50':>9}{'p90':>8}{'p99':>8}  (ms)")


def _row(e: Any, mark: str = "") -> str:
    t, p = e.ttft_s, e.tpot_s
    return (f"{e.shape.label:<16}{e.shape.devices:>8}{e.attainment:>8.1%}  {_ms(t[0]):>9}{_ms(t[1]):>9}"
            f"{_ms(t[2]):>9}  {_ms(p[0]):>9}{_ms(p[1]):>8}{_ms(p[2]):>8}  {mark}")


def print_rate_plan(planner: Any, plan: Any, out: TextIO) -> None:
    unit = _unit(planner)
    print(_header(planner, f"{plan.rate:g} req/s"), file=out)
    print(_columns(unit), file=out)
    best = {id(e) for e in plan.best}
    for e in plan.evaluated:
        print(_row(e, f"<- meets, fewest {unit}" if id(e) in best else ("meets" if e.meets else "")), file=out)
    if plan.best:
        print(f"best: {plan.best[0].shape.label}", file=out)
    else:
        n = max((e.shape.devices for e in plan.evaluated), default=0)
        print(f"no configuration of up to {n} {unit} meets the SLOs at {plan.rate:g} req/s", file=out)


def print_goodputs(planner: Any, n: int, found: list[Any], out: TextIO) -> None:
    unit = _unit(planner)
    print(_header(planner, f"{n} {unit}"), file=out)
    print(f"{'goodput':>10}  " + _columns(unit), file=out)
    for g in found:
        rate = "-" if g.rate is None else f"{g.rate:.3g}{'' if g.bounded else '+'}"
        if g.at_goodput is None:
            print(f"{rate:>10}  {g.shape.label:<16}{g.shape.devices:>8}  misses the SLOs at every rate tried",
                  file=out)
        else:
            print(f"{rate:>10}  " + _row(g.at_goodput), file=out)
    if found and found[0].rate is not None:
        print(f"best: {found[0].shape.label} at {found[0].rate:.3g} req/s (goodput, req/s; '+': a lower bound)",
              file=out)


def run(a: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if not 0 < a.attainment <= 1:
        raise ValueError(f"--attainment: must be in (0, 1], got {a.attainment}")
    planner = build_planner(a)
    if a.config is not None:
        return _one_config(planner, a, out)
    if a.rate is not None:
        plan = planner.for_rate(a.rate, a.max_workers)
        if a.json:
            json.dump({"mode": "rate", "rate": plan.rate, "slo_ms": _slo_ms(planner), "target": planner.target,
                       "best": [e.as_json() for e in plan.best],
                       "evaluated": [e.as_json() for e in plan.evaluated]}, out, indent=1)
            print(file=out)
        else:
            print_rate_plan(planner, plan, out)
        return 0 if plan.best else 1
    found = planner.for_workers(a.gpus)
    if a.json:
        json.dump({"mode": "gpus", "workers": a.gpus, "slo_ms": _slo_ms(planner), "target": planner.target,
                   "candidates": [g.as_json() for g in found]}, out, indent=1)
        print(file=out)
    else:
        print_goodputs(planner, a.gpus, found, out)
    return 0 if found and found[0].rate is not None else 1


def _one_config(planner: Any, a: argparse.Namespace, out: TextIO) -> int:
    """`--config`: one simulated run, reported as the bench reports a measured one."""
    from pdserve.cluster.bench.report import print_summary
    from pdserve.cluster.planner.planner import parse_shape
    from pdserve.cluster.planner.sim_metrics import summary
    from pdserve.cluster.planner.simulator import simulate

    if a.rate is None:
        raise ValueError("--config: give --rate (the rate to simulate it at), not --gpus")
    shape = parse_shape(a.config, planner.policy, planner.max_in_flight, planner.dispatch_s)
    result = simulate(planner.costs, planner.engine, shape, planner.workload.at_rate(a.rate))
    s = summary(result, planner.slo)
    if a.json:
        json.dump({"mode": "config", "config": shape.label, "rate": a.rate, "summary": s}, out, indent=1)
        print(file=out)
    else:
        print_summary(f"pdserve plan (simulated): {shape.label} at {a.rate:g} req/s", s, out)
        sim = s["simulated"]
        plans = ", ".join(f"{k} {v}" for k, v in sim["plans"].items())
        print(f"{'Simulated plans:':<40}{plans}", file=out)
        print(f"{'Simulated prefix hit rate:':<40}{sim['prefix_hit_rate']:.1%}", file=out)
        print(f"{'Simulated preemptions:':<40}{sim['preemptions']}", file=out)
    return 0


def _slo_ms(planner: Any) -> dict[str, float]:
    return {k: v * 1000 for k, v in planner.slo.as_dict().items()}
