"""`pdserve profile`: measure one worker's step and handoff costs on this machine, write a JSON profile.

The engine flags are `pdserve serve`'s (the same settings make the same engine);
the torch thread count defaults to what a worker of the default `pdserve serve`
(one prefill and one decode worker) gets on this machine. Progress goes to
stderr; the points and the cost models fitted to them to stdout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING

from pdserve.cluster.cli import settings_from_flags
from pdserve.cluster.cli_flags import UNSET, add_engine_args

if TYPE_CHECKING:
    from pdserve.cluster.planner.profile import Profile
    from pdserve.cluster.planner.profiler import Grid

DESCRIPTION = """\
Measure, through the real engine and KV transport, what the simulator and planner need:
prefill step time vs new and cached prompt tokens, decode step time vs batch and context,
KV handoff time vs bytes, and speculative acceptance (with --speculative). Writes a JSON
profile (cluster/planner/profile.py) and prints its points with the fitted cost models.

  pdserve profile --quick --out profile.json          a first look (a minute or two)
  pdserve profile --model tiny --out tiny.json        the tiny model, the full grid
"""

DEFAULT_SERVE_WORKERS = 2  # `pdserve serve` with no flags: one prefill and one decode worker


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a small grid and 3 repeats: tests, a first look")
    p.add_argument("--transport", default=UNSET,
                   help="the KV transport to time: zmq (default) or nccl (its gloo path when the cache is on the CPU)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="intra-op threads of the engine (default: what each worker of the default `pdserve serve` "
                        "gets here: the CPUs / 2 on a CPU machine, 1 with a GPU each)")
    p.add_argument("--prefill-tokens", type=_ints, default=None, metavar="N,N,...",
                   help="new prompt tokens per prefill step, nothing cached (kept to the step budget)")
    p.add_argument("--cached", type=_pairs, default=None, metavar="C:N,...",
                   help="prefill points after a cached prefix: C cached tokens, N new ones")
    p.add_argument("--batches", type=_ints, default=None, metavar="B,B,...", help="decode batch sizes")
    p.add_argument("--contexts", type=_ints, default=None, metavar="L,L,...", help="decode context lengths")
    p.add_argument("--transfer-tokens", type=_ints, default=None, metavar="N,N,...",
                   help="prompt lengths whose KV handoff is timed")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per point, median (default 5; quick 3)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per point (default 5)")
    p.add_argument("--max-step-s", type=float, default=None,
                   help="at a context, stop growing the decode batch once a step takes longer (default 2)")
    add_engine_args(p)


def run(a: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.cluster.planner.profiler import build_engine, profile_engine
    from pdserve.cluster.serve_config import serve_config

    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[profile {time.monotonic() - started:7.1f}s] {msg}", file=sys.stderr, flush=True)

    # The settings `pdserve serve` would take, through the same checks: the workers' EngineConfig.
    serve = serve_config(settings_from_flags(a, serving=True))  # serving: the default model's served name, too
    config = dataclasses.replace(serve.engine, progress=True)
    threads = a.torch_threads if a.torch_threads is not None else default_torch_threads(config.device)
    if threads < 1:
        raise ValueError(f"torch_threads: must be >= 1, got {threads}")
    grid = _grid(a)
    _check_out(a.out)
    progress(f"building the engine ({config.model}, {threads} torch thread(s))")
    engine = build_engine(config, threads)
    progress(f"engine ready: {engine.num_kv_blocks} KV blocks, max_model_len {engine.max_model_len}")
    # The name it is served as, short: the default model's, or a path's basename.
    profile = profile_engine(engine, grid, serve.transport, threads, progress, model_name=serve.served_names[-1])
    command = "pdserve " + shlex.join(sys.argv[1:])  # numbers carry the command that produced them
    profile = dataclasses.replace(profile, notes={**profile.notes, "command": command,
                                                   "seconds": round(time.monotonic() - started, 1)})
    profile.save(a.out)
    print_profile(profile)
    progress(f"wrote {a.out}")
    return 0


def _check_out(path: str) -> None:
    """ValueError naming --out unless the profile can be written there. It was first written
    after the whole profile (minutes of steps), and then failed as an OSError traceback: the
    measurements were lost."""
    from pathlib import Path

    out = Path(path)
    if out.is_dir():
        raise ValueError(f"out: {path} is a directory; give a file path")
    parent = out.parent
    if not parent.is_dir():
        raise ValueError(f"out: {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"out: {path}: cannot write there")


def default_torch_threads(device: str) -> int:
    """What each worker of the default `pdserve serve` runs with on this machine (cluster/placement.py)."""
    import torch

    from pdserve.cluster.placement import CpuSharing, worker_share
    from pdserve.workers.engine_setup import resolve_device

    gpus = torch.cuda.device_count() if resolve_device(device).type == "cuda" else 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return worker_share(device, DEFAULT_SERVE_WORKERS, {"CPU": cpus, "GPU": gpus}, CpuSharing.SPLIT).threads


def _grid(a: argparse.Namespace) -> Grid:
    import dataclasses

    from pdserve.cluster.planner.profiler import Grid

    given = {"prefill_tokens": a.prefill_tokens, "cached": a.cached, "batches": a.batches, "contexts": a.contexts,
             "transfer_tokens": a.transfer_tokens, "repeats": a.repeats, "decode_steps": a.decode_steps,
             "max_step_s": a.max_step_s}
    return dataclasses.replace(Grid.default(quick=a.quick), **{k: v for k, v in given.items() if v is not None})


def print_profile(p: Profile) -> None:
    """The points, each beside what the fitted model says of it, then the models."""
    costs = p.costs()
    print(f"# {p.model.get('name')} ({p.model.get('architecture')}, {p.model.get('dtype')}) on {p.machine.get('cpu')}, "
          f"{p.engine.torch_threads} thread(s), {p.engine.device}; transport {p.transport}")
    print("\nprefill   new  cached        ms    fit ms")
    for q in p.prefill:
        print(f"        {q.new_tokens:>6}  {q.cached_tokens:>6}  {q.seconds * 1e3:8.2f}  "
              f"{costs.prefill_s(q.new_tokens, q.cached_tokens) * 1e3:8.2f}")
    print("\ndecode  batch context       ms    fit ms")
    for d in p.decode:
        fit = costs.decode_s(d.batch, d.context)
        print(f"        {d.batch:>5}  {d.context:>6}  {d.seconds * 1e3:8.2f}  {fit * 1e3:8.2f}")
    print("\ntransfer     MB        ms    fit ms")
    for t in p.transfer:
        fit = costs.transfer_coef[0] + costs.transfer_coef[1] * t.bytes
        print(f"        {t.bytes / 1e6:8.2f}  {t.seconds * 1e3:8.2f}  {fit * 1e3:8.2f}")
    if p.speculative is not None:
        s = p.speculative
        print(f"\nspeculative {s.method} (k={s.num_speculative_tokens}): acceptance {s.acceptance_rate:.2f}, "
              f"{s.tokens_per_step:.2f} tokens per row per step")
    a, b, c = costs.prefill_coef
    print(f"\nfitted: prefill_s = {a * 1e3:.3f} ms + {b * 1e6:.3f} us/new token "
          f"+ {c * 1e9:.4f} ns x new x (cached + new/2)")
    a, b, c = costs.decode_coef
    print(f"        decode_s  = {a * 1e3:.3f} ms + {b * 1e6:.3f} us/row + {c * 1e9:.4f} ns x row x context"
          f" + {costs.decode_quad * 1e15:.4f} fs x (row x context)^2")
    ta, tb = costs.transfer_coef
    bandwidth = f"{1 / tb / 1e9:.2f} GB/s" if tb > 0 else "unbounded"
    print(f"        transfer_s = {ta * 1e3:.3f} ms + bytes / {bandwidth}; {p.kv_bytes_per_token} KV bytes per token")
    worst = costs.fitted.fit_errors(p)
    print("worst fit of the shapes: " + "; ".join(f"{k} {e * 100:+.0f}% at {where}" for k, (e, where) in worst.items())
          + " (the simulator scales them to the measured points: cluster/planner/cost_grid.py)")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, got {text!r}")
    return values


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(c), int(n)) for c, n in (item.split(":") for item in text.split(",") if item.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"CACHED:NEW pairs, comma-separated, got {text!r}") from None
    if not pairs or any(c < 0 or n < 1 for c, n in pairs):
        raise argparse.ArgumentTypeError(f"CACHED >= 0 and NEW >= 1, got {text!r}")
    return pairs
