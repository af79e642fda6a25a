"""A whole benchmark: build the workload once, run it at each rate, report.

`Session.run()` is the entry point; Ctrl-C during a run stops it and the
report covers what was measured so far (the cut run is marked interrupted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import aiohttp

from . import report
from .arrivals import arrival_offsets, rescale_to_rate
from .client import first_model, request_body
from .config import DEFAULT_NUM_REQUESTS, BenchConfig
from .metrics import Summary, summarize
from .runner import Plan, Run, execute
from .sweep import distserve_goodput
from .workloads import BenchRequest, WorkloadKind, load_trace, random_requests, shared_prefix_requests, trace_requests


def build_requests(cfg: BenchConfig) -> list[BenchRequest]:
    n = cfg.num_requests or DEFAULT_NUM_REQUESTS
    if cfg.workload is WorkloadKind.RANDOM:
        return random_requests(n, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.token_ids, cfg.seed)
    if cfg.workload is WorkloadKind.SHARED_PREFIX:
        return shared_prefix_requests(n, cfg.num_prefix_groups, cfg.prefix_len, cfg.input_len, cfg.output_len,
                                      cfg.range_ratio, cfg.token_ids, cfg.seed)
    rows = load_trace(cfg.trace, cfg.trace_time_unit)  # type: ignore[arg-type]
    if cfg.num_requests is not None:
        rows = rows[:cfg.num_requests]
    if not rows:
        raise ValueError(f"trace {cfg.trace}: no rows")
    return trace_requests(rows, cfg.block_size, cfg.token_ids, cfg.seed)


def build_prompts(cfg: BenchConfig, reqs: list[BenchRequest]) -> list[list[int] | str]:
    if cfg.tokenizer is None:
        return [r.prompt_ids for r in reqs]
    from .prompts import TextRenderer, load_tokenizer, usable_token_ids

    tok = load_tokenizer(cfg.tokenizer)
    renderer = TextRenderer(tok, usable_token_ids(tok), cfg.seed)
    return [renderer.render(r) for r in reqs]


def schedule(cfg: BenchConfig, reqs: list[BenchRequest], rate: float | None) -> tuple[float, list[float]]:
    """(the rate to report, send offsets). A timestamped trace keeps its own timing (sped up by
    --trace-speedup), or in a sweep is stretched to each rate with its shape kept."""
    stamps = [r.timestamp for r in reqs]
    if all(t is not None for t in stamps):
        ts = [t for t in stamps if t is not None]
        if rate is not None:
            return rate, rescale_to_rate(ts, rate)
        ts = [t / cfg.trace_speedup for t in ts]
        span = ts[-1] - ts[0]
        return ((len(ts) - 1) / span if span > 0 else float("inf")), ts
    r = cfg.request_rate if rate is None else rate
    return r, arrival_offsets(len(reqs), r, cfg.burstiness, cfg.seed)


@dataclass
class Session:
    cfg: BenchConfig
    out: TextIO = field(default_factory=lambda: sys.stdout)  # looked up late: tests swap sys.stdout
    runs: list[Run] = field(default_factory=list)
    model: str | None = None
    _reqs: list[BenchRequest] = field(default_factory=list)
    _prompts: list[list[int] | str] = field(default_factory=list)

    def prepare(self) -> None:
        """Build prompts before any clock starts (text rendering can take seconds)."""
        self._reqs, self._prompts = self._workload(0)

    def _workload(self, index: int) -> tuple[list[BenchRequest], list[list[int] | str]]:
        """The requests of the index-th rate of a sweep: the same lengths, arrivals and
        sharing pattern, other token content (seed + index), so that no rate is served
        from the prefix cache the rate before it filled."""
        cfg = dataclasses.replace(self.cfg, seed=self.cfg.seed + index)
        reqs = build_requests(cfg)
        return reqs, build_prompts(cfg, reqs)

    async def _main(self) -> None:
        cfg = self.cfg
        rates: list[float | None] = list(cfg.sweep) if cfg.sweep else [None]
        # enough pooled connections that no request waits inside the client after its clock started
        limit = max(1, cfg.max_concurrency or len(self._reqs))
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        # Each request has its own deadline (client.send); the session's own total timeout is off.
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=limit),
                                         timeout=aiohttp.ClientTimeout(total=None), trust_env=False) as client:
            self.model = cfg.model or await first_model(client, cfg.base_url, min(cfg.request_timeout, 30.0))
            for i, rate in enumerate(rates):
                if i:  # fresh prompts per rate: the last rate's would hit the server's prefix cache
                    self._reqs, self._prompts = self._workload(i)
                bodies = [request_body(cfg.endpoint, self.model, p, r.output_len, cfg.ignore_eos, cfg.temperature)
                          for p, r in zip(self._prompts, self._reqs)]
                shown, offsets = schedule(cfg, self._reqs, rate)
                plan = Plan(cfg.base_url + cfg.endpoint.path, bodies, [r.input_len for r in self._reqs],
                            [r.output_len for r in self._reqs], offsets, cfg.max_concurrency, cfg.request_timeout,
                            self._token_counter())
                run = Run(shown)
                self.runs.append(run)
                await execute(plan, run, client, cfg.progress)
                self._print_run(run)

    def _token_counter(self) -> Callable[[str], int] | None:
        """With --tokenizer, how many tokens a text is (vLLM's count of an output whose server sent
        no usage); None without one (the client counts token chunks)."""
        if self.cfg.tokenizer is None:
            return None
        from .prompts import load_tokenizer

        tok = load_tokenizer(self.cfg.tokenizer)
        return lambda text: len(tok.encode(text, add_special_tokens=False))

    def run(self) -> int:
        """Prepare, run every rate, report. Exit status: 0, 1 if no request succeeded, 130 on Ctrl-C."""
        self.prepare()
        interrupted = False
        try:
            asyncio.run(self._main())
        except KeyboardInterrupt:
            interrupted = True
            if self.runs:
                self.runs[-1].interrupted = True
                self._print_run(self.runs[-1])
            print("pdserve bench: interrupted; reporting what was measured", file=sys.stderr)
        self._report()
        if interrupted:
            return 130
        return 0 if any(r.success for run in self.runs for r in run.records) else 1

    def _print_run(self, run: Run) -> None:
        title = f"pdserve bench: {run.rate:g} req/s" + (" (interrupted)" if run.interrupted else "")
        report.print_summary(title, summarize(run.records, run.duration, self.cfg.slo), self.out)

    def _report(self) -> None:
        cfg = self.cfg
        summaries = [summarize(run.records, run.duration, cfg.slo) for run in self.runs]
        sweep = None
        if cfg.sweep and cfg.slo and self.runs:
            points = [_point(run, s) for run, s in zip(self.runs, summaries)]
            best = distserve_goodput([p["request_rate"] for p in points], [p["attainment"] for p in points])
            report.print_sweep(points, best, self.out)
            sweep = report.sweep_dict(points, best)
            if cfg.plot_dir:
                from .plots import plot_attainment

                per = {k: [p["attainment_by_slo"][k] for p in points] for k in cfg.slo.as_dict()}
                plot_attainment(Path(cfg.plot_dir) / "attainment_vs_rate.png", [p["request_rate"] for p in points],
                                [p["attainment"] for p in points], per, best)
        if cfg.plot_dir and self.runs:
            self._plot_cdfs()
        if cfg.result_json:
            runs = [report.run_dict(run.rate, run.interrupted, s, run.records) for run, s in zip(self.runs, summaries)]
            report.write_json(cfg.result_json, self._config_json(), runs, sweep)

    def _plot_cdfs(self) -> None:
        from .plots import plot_cdf

        d = Path(self.cfg.plot_dir)  # type: ignore[arg-type]
        slo = self.cfg.slo
        ok = {f"{run.rate:g} req/s": [r for r in run.records if r.success] for run in self.runs}
        plot_cdf(d / "ttft_cdf.png", "TTFT", {k: [r.ttft for r in v if r.ttft is not None] for k, v in ok.items()},
                 slo.ttft if slo else None)
        plot_cdf(d / "tpot_cdf.png", "TPOT", {k: [t for r in v if (t := r.tpot) is not None] for k, v in ok.items()},
                 slo.tpot if slo else None)
        plot_cdf(d / "itl_cdf.png", "ITL", {k: [g for r in v for g in r.itl] for k, v in ok.items()}, None,
                 unit="gaps between chunks")

    def _config_json(self) -> dict[str, object]:
        return {**self.cfg.as_json(), "model": self.model, "argv": sys.argv,
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "python": platform.python_version()}}


def _point(run: Run, s: Summary) -> report.SweepPoint:
    g = s["goodput"]
    return {"request_rate": run.rate, "attainment": (g["attainment"] if g is not None else None) or 0.0,
            "attainment_by_slo": g["attainment_by_slo"] if g is not None else {},
            "request_goodput": g["request_goodput"] if g is not None else None,
            "completed": s["completed"], "failed": s["failed"], "interrupted": run.interrupted,
            "p99_ttft_s": s["ttft_s"]["p99"], "p99_tpot_s": s["tpot_s"]["p99"]}
