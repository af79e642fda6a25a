"""A live pdserve under `pdserve bench`, scraped by a real Prometheus (issue 6's last checks).

One module-scoped setup, to keep CI time low: a disaggregated pdserve on local Ray (1
prefill + 1 decode worker, the tiny model; started and stopped as in
tests/cluster/test_metrics.py), a real `prometheus` on 127.0.0.1 scraping its /metrics
every second with the repo's rule files loaded and evaluated every second, and one
`pdserve bench` run against it (the CLI's `main`, in process), with shared prefixes so
that prefix-cache hits, KV transfers and the router's cache counters move.

- The bench writes its JSON and PNGs.
- The bench's per-request TTFT and TPOT agree with the server's own histograms, scraped
  just before and just after the run, within bucket resolution (`test_ttft_...`,
  `test_tpot_...` say what that can promise).
- Every PromQL expression of the dashboard and of the rules returns data from that
  Prometheus, and numbers (latency quantiles, token rates, SLO ratios, ...), not the NaN
  of 0/0 that every ratio shows before traffic, but where NaN is right (the prefill
  worker's decode-batch and speculation ratios: it neither decodes nor drafts).

Skips without `prometheus` on PATH; fails instead with PDSERVE_REQUIRE_PROMETHEUS=1 (CI).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import local_cluster, tiny_spec
from machine_speed import SLOWDOWN
from prometheus_client.parser import text_string_to_metric_families
from promql import (
    DASHBOARD,
    RULES_DIR,
    PrometheusServer,
    PromQLError,
    dashboard_expressions,
    find_binary,
    free_port,
    metric_names,
    rule_expressions,
    write_config,
)

from pdserve.workers.tiny.builder import TinyModelSpec

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

TTFT = "pdserve:time_to_first_token_seconds"
TPOT = "pdserve:time_per_output_token_seconds"
NUM_REQUESTS = 20
BENCH_ARGS = [
    # 2 groups sharing a 64-token prefix; whole prompts of 72..120 tokens, so the
    # uncached suffix is mostly over the router's local-prefill threshold (16 tokens)
    # and sometimes under it: both routes, KV transfers, prefix-cache hits.
    "--workload", "shared-prefix", "--num-prefix-groups", "2", "--prefix-len", "64",
    "--input-len", "96", "--output-len", "24", "--range-ratio", "0.25",
    "--num-requests", str(NUM_REQUESTS), "--request-rate", "8", "--seed", "3",
    "--goodput", "ttft:500", "tpot:50", "--request-timeout", "60", "--no-progress",
]
WAIT_S = 30.0  # each bounded wait on Prometheus (first scrape; scrapes and rule evaluations after the load)

# TTFT: the client's clock runs longer than the server's by the transport overhead
# (client send -> gateway handler, plus the first chunk's way back through Serve's proxy
# actor), which on 2 loaded cores is anything from a few ms to tens of ms, and is slower
# on a slower machine (docs/observability.md, "Tests"). So it is measured in the same
# run: a probe thread times GET /v1/models (the same hops, no engine) every PROBE_EVERY_S
# while the bench runs. A request the server counts at or below a bound, the client
# counts at or below that bound plus TTFT_SHIFT_VS_SLOWEST_PROBE times the slowest probe,
# but for TTFT_LATE_REQUESTS; and the mean overhead is at most TTFT_OVERHEAD_VS_PROBE
# times the probes' mean plus TTFT_OVERHEAD_SLACK_S. The streamed request's overhead is
# larger than a probe's (the bench's event loop also reads the other streams): measured
# 1.3-1.7x the probes' mean, its shift 0.5-0.85x of the slowest probe (docs/observability.md).
PROBE_EVERY_S = 0.1
TTFT_LATE_REQUESTS = 2
TTFT_SHIFT_VS_SLOWEST_PROBE = 1.5
TTFT_OVERHEAD_VS_PROBE = 2.5
TTFT_OVERHEAD_SLACK_S = 0.005
# TPOT: a bound on |d_last - d_first|, the difference between the delivery delays (server
# send -> client receive) of a request's last and first token chunks, which is what
# separates the two TPOTs: (E2E - TTFT) on each side is last chunk - first chunk on its
# own clock. The bound is several times the largest measured (docs/observability.md,
# "Tests"), on a machine of the speed machine_speed.py names; a slower one delays deliveries more
# (2.4x slower, 0.4 of a CPU: past 10 ms). A request's TPOTs then differ by at most this / (output
# tokens - 1).
TPOT_DELIVERY_JITTER_S = 0.010 * SLOWDOWN
# ... but for a request whose first or last chunk was held up longer, by a stall of the
# client's event loop (it shares the pytest process with Ray's driver threads) or of
# Serve's proxy actor on loaded cores: now and then a client TPOT just above the 5 ms
# bound whose server TPOT was below it (how often: docs/observability.md, "Tests"). One
# such request is allowed per bound; the sum check below is not loosened (one 100 ms
# stall moves it < 5 ms).
TPOT_STALLED_REQUESTS = 1


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    return find_binary("prometheus")  # skips (or fails, in CI) before anything starts


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))  # test_metrics' model


@pytest.fixture(scope="module")
def served(prometheus_binary: str, model_dir: Path) -> Iterator[tuple[str, Any]]:
    """As tests/cluster/test_metrics.py's `served`: Serve's Python proxy ingress (HAProxy's
    fixed ports may be held by another cluster on this machine), ngram speculation (the
    speculative-decoding series get their `position` labels, and chunks carry several
    tokens, so TPOT per token and per chunk differ), local Ray on 2 CPUs, always torn down."""
    from pdserve.cluster.serve_config import serve_config

    cfg = serve_config({"model": str(model_dir), "port": free_port(), "max_model_len": 256, "ingress": "proxy",
                        "num_kv_blocks": 128, "speculative": "ngram"})
    with local_cluster(cfg) as url:
        yield url, cfg


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: httpx.Client) -> Samples:
    """Every sample of one GET /metrics, by (sample name, sorted labels)."""
    r = client.get("/metrics")
    r.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


@dataclass
class Live:
    prom: PrometheusServer
    bench_json: Path
    plot_dir: Path
    bench_exit: int
    before: Samples  # /metrics just before the bench (after the warm-up)
    after: Samples  # just after it: only the bench's requests in between
    load_start: float  # time.time() when the bench started
    load_end: float  # and when it returned
    probe_s: list[float]  # round trips of GET /v1/models during the load (TransportProbe)

    def requests(self) -> list[dict[str, Any]]:
        (run,) = json.loads(self.bench_json.read_text())["runs"]
        return run["requests"]

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)

    def cumulative(self, histogram: str) -> dict[float, float]:
        """The bench's share of the server's histogram: {le: requests <= le}, +Inf included."""
        bounds = {dict(ls)["le"] for n, ls in self.after if n == f"{histogram}_bucket"}
        return {float(le): self.delta(f"{histogram}_bucket", le=le) for le in bounds}


class TransportProbe:
    """Times GET /v1/models through Serve's proxy and the gateway (what a streamed
    request's TTFT holds besides the engine's part) every PROBE_EVERY_S, on its own
    thread and connection, until stopped (or after `max_s`)."""

    def __init__(self, url: str, max_s: float = 120.0) -> None:
        self.url, self.max_s = url, max_s
        self.round_trips: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transport-probe", daemon=True)

    def __enter__(self) -> TransportProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                start = time.perf_counter()
                r = client.get("/v1/models")
                if r.status_code == 200:
                    self.round_trips.append(time.perf_counter() - start)
                self._stop.wait(PROBE_EVERY_S)


@pytest.fixture(scope="module")
def live(served: tuple[str, Any], prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from pdserve.cluster.cli import main as pdserve_main

    url, cfg = served
    tmp = tmp_path_factory.mktemp("live")
    config = write_config(tmp / "prometheus.yml", targets=[f"127.0.0.1:{cfg.port}"], scrape_interval="1s",
                          rule_files=sorted(RULES_DIR.glob("*.yml")))  # evaluation_interval: 1s too
    with PrometheusServer(config, tmp / "prometheus", binary=prometheus_binary, ready_timeout_s=60) as prom, \
            httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        # A scrape before the load, so that rates over the load have a starting sample.
        _wait_for(lambda: _latest(prom, 'up{job="pdserve"}') == 1.0, WAIT_S,
                  "Prometheus scraped the gateway successfully", prom)
        model = os.path.basename(cfg.model)
        for i in range(2):  # warm-up (first-request costs), outside the measured window
            r = client.post("/v1/completions", json={"model": model, "prompt": list(range(100 + i, 180 + i)),
                                                     "max_tokens": 8, "stream": True, "ignore_eos": True})
            assert r.status_code == 200 and "[DONE]" in r.text, r.text[-500:]
        before = scrape(client)
        bench_json, plot_dir = tmp / "bench" / "result.json", tmp / "bench" / "plots"
        load_start = time.time()
        with TransportProbe(url) as probe:
            code = pdserve_main(["bench", "--base-url", f"{url}/v1", *BENCH_ARGS,
                                 "--result-json", str(bench_json), "--plot-dir", str(plot_dir)])
        load_end = time.time()
        after = scrape(client)
        yield Live(prom, bench_json, plot_dir, code, before, after, load_start, load_end, probe.round_trips)


def _latest(prom: PrometheusServer, expr: str) -> float | None:
    result = prom.query(expr)["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(ready: Callable[[], bool], timeout_s: float, what: str, prom: PrometheusServer) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {timeout_s:g}s: {what}; prometheus log:\n{prom.log_tail()}")
        time.sleep(0.25)


# --- the bench's outputs ---------------------------------------------------------------

def test_bench_writes_json_and_pngs(live: Live) -> None:
    assert live.bench_exit == 0
    assert live.bench_json.stat().st_size > 0
    reqs = live.requests()
    assert len(reqs) == NUM_REQUESTS
    failed = [(r["index"], r["error"]) for r in reqs if not r["success"]]
    assert not failed, failed
    for name in ("ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png"):
        png = live.plot_dir / name
        assert png.is_file() and png.stat().st_size > 0, png
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_shared_prefixes_move_the_cache_and_transfer_counters(live: Live) -> None:
    assert live.delta("pdserve:router_cached_prompt_tokens_total") > 0
    assert live.delta("pdserve:prefix_cache_hits_total", pool="prefill") > 0
    assert live.delta("pdserve:kv_transfer_bytes_total", pool="prefill") > 0


# --- the bench's TTFT / TPOT against the server's histograms ---------------------------

def _client_cum(values: Sequence[float], le: float) -> int:
    return sum(1 for v in values if v <= le)


def _cumulative_mismatches(server: dict[float, float], client: Sequence[float],
                           same_tol: Callable[[float], int], next_tol: Callable[[float, float], int] | None = None,
                           reverse_tol: Callable[[float], int] | None = None) -> list[str]:
    """For each bucket bound le (and the next one up, nxt):
        server_cum(le) >= client_cum(le) - same_tol(le)          [no later than the client, same bucket]
    with `next_tol`: client_cum(nxt) >= server_cum(le) - next_tol(le, nxt) [at most one bucket earlier]
    and with `reverse_tol`: client_cum(le) >= server_cum(le) - reverse_tol(le) [same bucket, other way].
    Returns a line per failed bound, with the whole table after it when any failed."""
    bounds = sorted(server)
    bad = []
    for i, le in enumerate(bounds):
        s, c = server[le], _client_cum(client, le)
        if s < c - same_tol(le):
            bad.append(f"le={le:g}: server {s:g} < client {c} - {same_tol(le)}")
        if reverse_tol is not None and c < s - reverse_tol(le):
            bad.append(f"le={le:g}: client {c} < server {s:g} - {reverse_tol(le)}")
        if next_tol is not None and i + 1 < len(bounds):
            nxt = bounds[i + 1]
            cn = _client_cum(client, nxt)
            if cn < s - next_tol(le, nxt):
                bad.append(f"le={le:g}: client {cn} at le={nxt:g} < server {s:g} - {next_tol(le, nxt)}")
    if bad:
        bad.append("le: server/client cumulative counts: " +
                   ", ".join(f"{le:g}: {server[le]:g}/{_client_cum(client, le)}" for le in bounds))
    return bad


def test_ttft_agrees_with_the_server_histogram(live: Live) -> None:
    """Per request the server's TTFT (HTTP handler start -> first token chunk handed to
    the response) lies inside the client's (just before the POST -> first token chunk
    read), so server <= client exactly: a request in the client's bucket or below is in
    the server's too, and the server's sum is at most the client's. The other way the
    client is later by the transport overhead, which this run measures with its probe
    (TransportProbe): a request the server counts at or below a bound, the client counts
    at or below that bound plus a margin over the slowest probe round trip (but for
    TTFT_LATE_REQUESTS), and the mean overhead stays within a multiple of the probes'. This
    fails when the server's clock starts late (or stops early) by more than the transport
    takes, or when it counts other requests."""
    reqs = [r for r in live.requests() if r["success"]]
    client = [r["ttft"] for r in reqs]
    assert live.delta(f"{TTFT}_count") == len(reqs) == NUM_REQUESTS
    server = live.cumulative(TTFT)
    assert server[math.inf] == len(reqs)
    probe = live.probe_s
    assert len(probe) >= 10, f"the transport probe timed {len(probe)} round trips during the load"
    slowest, probe_mean = max(probe), statistics.fmean(probe)
    shift = TTFT_SHIFT_VS_SLOWEST_PROBE * slowest
    bad = _cumulative_mismatches(server, client, same_tol=lambda le: 0)
    for le, s in sorted(server.items()):
        c = _client_cum(client, le + shift)
        if c < s - TTFT_LATE_REQUESTS:
            bad.append(f"le={le:g}: client {c} at le + {TTFT_SHIFT_VS_SLOWEST_PROBE:g} x slowest probe "
                       f"({le + shift:.3f}) < server {s:g} - {TTFT_LATE_REQUESTS}")
    server_sum, client_sum = live.delta(f"{TTFT}_sum"), sum(client)
    overhead = (client_sum - server_sum) / len(reqs)
    if server_sum > client_sum + 1e-6:
        bad.append(f"sum: server {server_sum:.6f} s > client {client_sum:.6f} s (server TTFT longer than the client's)")
    if overhead > TTFT_OVERHEAD_VS_PROBE * probe_mean + TTFT_OVERHEAD_SLACK_S:
        bad.append(f"mean overhead {overhead * 1e3:.1f} ms > {TTFT_OVERHEAD_VS_PROBE:g} x the probes' mean "
                   f"{probe_mean * 1e3:.1f} ms + {TTFT_OVERHEAD_SLACK_S * 1e3:g} ms")
    ordered = sorted(client)  # the shift the bound check needed: how near the slowest probe it came
    needed = max((ordered[int(s) - TTFT_LATE_REQUESTS - 1] - le for le, s in server.items()
                  if math.isfinite(le) and s > TTFT_LATE_REQUESTS), default=0.0)
    print(f"TTFT overhead: mean {overhead * 1e3:.1f} ms, shift needed {needed * 1e3:.1f} ms; probe round trips: "
          f"{len(probe)}, mean {probe_mean * 1e3:.1f} ms, median {statistics.median(probe) * 1e3:.1f} ms, "
          f"max {slowest * 1e3:.1f} ms")
    if bad:
        if not any(line.startswith("le: ") for line in bad):
            bad.append("le: server/client cumulative counts: " +
                       ", ".join(f"{le:g}: {server[le]:g}/{_client_cum(client, le)}" for le in sorted(server)))
        pytest.fail(f"{TTFT} vs the bench's TTFT (mean transport overhead {overhead * 1e3:.1f} ms; probe round "
                    f"trips mean {probe_mean * 1e3:.1f} ms, slowest {slowest * 1e3:.1f} ms):\n" + "\n".join(bad),
                    pytrace=False)


def test_tpot_agrees_with_the_server_histogram(live: Live) -> None:
    """Both sides compute TPOT per request as (E2E - TTFT) / (output tokens - 1), i.e.
    (last token chunk - first token chunk) / (tokens - 1), each on its own clock, so a
    request's two values differ by (d_last - d_first) / (tokens - 1), with d a chunk's
    delivery delay; with |d_last - d_first| <= TPOT_DELIVERY_JITTER_S that is under a
    millisecond here, less than any bucket's width. "Within bucket resolution" is then:
    the same bucket on both sides but for the requests whose client value lies within
    that margin of a bound (counted per bound, usually none) and one stalled request
    (TPOT_STALLED_REQUESTS), at most one bucket apart for all but that one; and the sums
    within the summed margins.

    On this fast model most TPOTs fall in the lowest bucket, so the buckets say little;
    the sums carry the check. With ngram speculation a chunk carries several tokens, so
    a server counting chunks instead of tokens (TPOT per chunk, observed once per chunk
    or divided by chunks - 1) fails the count or the sum."""
    reqs = [r for r in live.requests() if r["success"] and r["output_tokens"] >= 2]
    assert len(reqs) == NUM_REQUESTS
    assert sum(r["chunks"] for r in reqs) < sum(r["output_tokens"] for r in reqs), \
        "no chunk carried more than one token: speculation is off, per chunk == per token, the check is blind to it"
    client = [r["tpot"] for r in reqs]
    margin = [TPOT_DELIVERY_JITTER_S / (r["output_tokens"] - 1) for r in reqs]

    def near_below(le: float) -> int:  # client value at or below le that the server may have just above
        return sum(1 for c, m in zip(client, margin) if le - m < c <= le)

    def near_above(le: float) -> int:
        return sum(1 for c, m in zip(client, margin) if le < c <= le + m)

    assert live.delta(f"{TPOT}_count") == len(reqs)
    server = live.cumulative(TPOT)
    assert server[math.inf] == len(reqs)
    bad = _cumulative_mismatches(server, client, same_tol=lambda le: near_below(le) + TPOT_STALLED_REQUESTS,
                                 next_tol=lambda le, nxt: TPOT_STALLED_REQUESTS,
                                 reverse_tol=lambda le: near_above(le) + TPOT_STALLED_REQUESTS)
    server_sum, client_sum = live.delta(f"{TPOT}_sum"), sum(client)
    per_chunk = sum((r["e2e"] - r["ttft"]) / (r["chunks"] - 1) for r in reqs if r["chunks"] >= 2)
    if abs(server_sum - client_sum) > sum(margin):
        bad.append(f"sum: server {server_sum * 1e3:.3f} ms vs client {client_sum * 1e3:.3f} ms: more apart than "
                   f"{sum(margin) * 1e3:.3f} ms (the client's per-chunk sum would be {per_chunk * 1e3:.3f} ms)")
    if bad:
        pytest.fail(f"{TPOT} vs the bench's TPOT:\n" + "\n".join(bad), pytrace=False)


# --- every dashboard and rule expression on the live Prometheus ------------------------

# Where NaN (0/0 over the window) is right after this load, by metric-name prefix: only
# on the prefill worker's series, which never decodes, so never drafts either. Every other
# sample of every expression must be a number: the load moves every other denominator
# (both pools step and prefill, the decode worker too for the short uncached suffixes; KV
# is sent; every latency histogram fills), so a NaN there means a series that does not
# move when it should, or an expression that divides by the wrong thing.
NAN_ONLY_ON_PREFILL = ("pdserve:iteration_decode_batch_size", "pdserve:spec_decode_")


def _nan_allowed(expr: str, labels: dict[str, str]) -> bool:
    return labels.get("pool") == "prefill" and any(n.startswith(NAN_ONLY_ON_PREFILL) for n in metric_names(expr))


def _parse_time(text: str) -> float:
    """Prometheus' RFC 3339 timestamps (nanoseconds, 'Z') as Unix seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + (float("0." + frac) if frac else 0.0)


def _wait_for_load_scraped_and_evaluated(live: Live) -> None:
    """Until Prometheus holds >= 3 scrapes since the load began, the last of them after
    it ended with the final request count, and every rule group has been evaluated
    after that scrape (recording rules, and the alerts reading them)."""
    prom, final = live.prom, total(live.after, f"{TTFT}_count")
    scraped_at: list[float] = []

    def scraped() -> bool:
        window = max(1, math.ceil(time.time() - live.load_start))
        count = _latest(prom, f"{TTFT}_count")
        at = _latest(prom, f"timestamp({TTFT}_count)")
        samples = _latest(prom, f"count_over_time({TTFT}_count[{window}s])")
        if count == final and at is not None and at > live.load_end and (samples or 0) >= 3:
            scraped_at.append(at)
            return True
        return False

    _wait_for(scraped, WAIT_S, f"a scrape after the load showing {TTFT}_count = {final:g}", prom)

    def evaluated() -> bool:
        return all(_parse_time(g["lastEvaluation"]) > scraped_at[0] + 1 for g in prom.api("rules")["groups"])

    _wait_for(evaluated, WAIT_S, "every rule group evaluated after the load's last scrape", prom)


def test_every_dashboard_and_rule_expression_returns_data(live: Live) -> None:
    _wait_for_load_scraped_and_evaluated(live)
    prom, at = live.prom, time.time()  # one evaluation time for all: the 1m windows hold the load
    failures = []
    for group in prom.api("rules")["groups"]:
        for rule in group["rules"]:
            if rule.get("health") != "ok":
                failures.append(f"rule {rule['name']} (group {group['name']}): health {rule.get('health')}: "
                                f"{rule.get('lastError')}")
    exprs = [("dashboard", e) for e in dashboard_expressions(DASHBOARD)] + \
            [("rules", e) for e in rule_expressions(RULES_DIR)]
    for source, expr in exprs:
        try:
            result = prom.query(expr, at=at)["result"]
        except PromQLError as e:
            failures.append(f"{source}: error {e}")
            continue
        if not result:
            failures.append(f"{source}: no data: {expr}")
            continue
        nan = [r["metric"] for r in result if math.isnan(float(r["value"][1])) and not _nan_allowed(expr, r["metric"])]
        if nan:
            failures.append(f"{source}: NaN for {nan}: {expr}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(exprs)} expressions (and rule health) failed on the live Prometheus:\n"
                    + "\n".join(failures), pytrace=False)
