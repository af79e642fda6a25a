"""The gateway's Prometheus metrics, and the one exposition `GET /metrics` serves.

Latencies are measured where the user feels them: `RequestMetrics` starts when
the HTTP handler starts and ticks when a chunk carrying tokens goes to the client
(openai_app.py calls it). Router counters are read from the router's own
`RouterStats` at scrape time, and the backend's health and failure counters
(pools' live workers, migrations, lost and restarted workers, token-stream gaps)
from its `Reliability`. Each scrape also fetches every worker's exposition
(`metrics()` on its actor) concurrently under one deadline, merges the samples of
each family across workers, and renders them with the gateway's own families as
one exposition (one HELP/TYPE per family). `pdserve:worker_up` says which
fetches made it. Parsing the workers' texts and rendering run on a thread, off
the event loop: their cost grows with the workers, and on the loop it would
delay every stream's next token by as much.

Names, labels and buckets are the metric contract that deploy/'s rules and
dashboard are written against: do not rename.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.cluster.limits import RefusalReason
from pdserve.cluster.metrics_peers import (
    PeerStore,
    in_store_thread,
    labelled,
    pack,
    publish_forever,
    read_peers,
)
from pdserve.cluster.metrics_peers import stop as stop_publisher
from pdserve.cluster.router import DecodeReason, RouteReason, RouterStats
from pdserve.cluster.worker_handle import WorkerHandle
from pdserve.cluster.worker_metrics import WithoutCreated
from pdserve.workers.outputs import RequestOutput

if TYPE_CHECKING:
    from pdserve.cluster.backend_api import Reliability

log = logging.getLogger(__name__)

# Each tops out past the default request deadline (600 s) and the slowest figure a worker can show:
# a quantile above a histogram's last finite bound reads as that bound (vLLM's reach as far).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 2.5, 5, 7.5, 10, 20,
                40, 80, 160, 640)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5,
                5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920)
# Prompt and output lengths per finished request: 1-2-5 steps (vLLM's), up to 500k tokens.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
# Finish reasons of choices that succeeded (a failure is counted in request_errors, by status, as
# vLLM counts no finish for a request a client aborts).
FINISH_REASONS = ("stop", "length")
ERROR_CODES = ("400", "401", "404", "429", "499", "500", "503", "504")
HEALTH_STATES = ("ok", "degraded", "unavailable")  # `Health.status`
WORKER_SCRAPE_DEADLINE_S = 2.0

# Actor name -> (pool, actor handle): its `metrics()` returns the worker's exposition. None: a worker
# of the pool not found (not started yet, or gone): its worker_up is 0.
WorkerHandles = Mapping[str, tuple[str, WorkerHandle | None]]


class GatewayMetrics:
    """The gateway's registry. `router_stats` returns the disaggregated router's
    counters (None without a router: the families export zeros); `reliability`
    the backend's health and failure counters (None: counters export zeros, and
    pools and health nothing)."""

    def __init__(self, router_stats: Callable[[], RouterStats | None] = lambda: None,
                 reliability: Callable[[], Reliability | None] = lambda: None, replica: int = 0,
                 replicas: int = 1) -> None:
        # This replica's rank of `replicas`: with more than one, its families carry a replica
        # label and the others' come in through `peers` (cluster/metrics_peers.py).
        self.replica, self.replicas = replica, replicas
        self.peers: PeerStore | None = None
        self._publisher: asyncio.Task[None] | None = None
        # Puts to the store in the order their families were collected (see `_publish`).
        self._collected = self._put_seq = 0
        self._put_lock = threading.Lock()
        self.registry = r = CollectorRegistry()
        self.requests_total = Counter("pdserve:gateway_requests", "HTTP requests by endpoint and status",
                                      ["endpoint", "status"], registry=r)
        self.ttft = Histogram("pdserve:time_to_first_token_seconds",
                              "Request arrival at the gateway to its first token sent", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds",
                              "Per request with >= 2 output tokens: (E2E - TTFT) / (output tokens - 1)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds",
                             "Gaps between tokens sent (a chunk of m tokens after gap g: m observations of g/m)",
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request arrival to its last token sent",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds",
                                    "Time each choice waited in its first worker's scheduler queue",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        # Per finished request: the lengths the planner loop re-plans on (cluster/planner/traffic.py).
        self.request_prompt_tokens = Histogram("pdserve:request_prompt_tokens",
                                               "Prompt tokens per finished request (per choice)",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("pdserve:request_generation_tokens",
                                                   "Tokens sent per finished request", buckets=TOKEN_BUCKETS,
                                                   registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens",
                                         "Tokens generated for clients (as usage counts them; a failed request's too)",
                                         registry=r)
        self.success = Counter("pdserve:request_success", "Finished requests (per choice) by finish reason",
                               ["finished_reason"], registry=r)
        self.errors = Counter("pdserve:request_errors", "Failed requests by HTTP status (or in-band stream error)",
                              ["code"], registry=r)
        self.refused = Counter("pdserve:requests_refused",
                               "Requests turned away before they ran, and clients dropped for not reading, by reason",
                               ["reason"], registry=r)
        # Held by each request's admission (cluster/gateway.py `Admission`), its tokenizing included.
        self.in_flight = Gauge("pdserve:num_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.queued = Gauge("pdserve:num_requests_queued", "Requests admitted with no token sent yet", registry=r)
        self.planner = PlannerMetrics(r)
        self._worker_series: set[tuple[str, str]] = set()  # the (pool, worker) label sets exported
        # Apart from this replica's own families: what this scrape's fetch saw, shown (like the
        # workers' families) by the replica that answers only, never published to its peers. A
        # replica's worker_up is only as fresh as its last scrape, and one that last fetched while
        # a worker was down republished that 0 for as long as scrapes reached the other replicas.
        self._fetch_registry = CollectorRegistry()
        self.worker_up = Gauge("pdserve:worker_up", "1 if the last metrics fetch from the worker succeeded in time",
                               ["pool", "worker"], registry=self._fetch_registry)
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        for code in ERROR_CODES:
            self.errors.labels(code)
        for refusal in RefusalReason:
            self.refused.labels(refusal.value)
        self._scrape: asyncio.Future[bytes] | None = None
        r.register(_RouterCollector(router_stats))
        r.register(_ReliabilityCollector(reliability))

    def request(self) -> RequestMetrics:
        """A request arrived (call where the HTTP handler starts)."""
        return RequestMetrics(self)

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def refuse(self, reason: RefusalReason | None, status: int | None) -> None:
        """A request failed with `status` (None: none was sent), refused for `reason` (None: it ran)."""
        if reason is not None:
            self.refused.labels(reason.value).inc()
        if status is not None:
            self.error(status)

    async def exposition(self, workers: WorkerHandles, deadline_s: float = WORKER_SCRAPE_DEADLINE_S) -> bytes:
        """The gateway's metrics and every worker's, as one text exposition.
        Returns within `deadline_s` (plus parsing) whatever the workers do.
        Scrapes that overlap share one fetch from the workers: however many
        clients scrape at once, each worker is asked once at a time."""
        scrape = self._scrape
        if scrape is None or scrape.done() or scrape.get_loop() is not asyncio.get_running_loop():
            self._scrape = scrape = asyncio.ensure_future(self._exposition(workers, deadline_s))
        return await asyncio.shield(scrape)  # one scraper going away does not cancel the others'

    async def _exposition(self, workers: WorkerHandles, deadline_s: float) -> bytes:
        names = list(workers)
        texts = await asyncio.gather(*(_fetch(workers[n][1], deadline_s) for n in names))
        parsed = await asyncio.to_thread(lambda: [_parse(n, t) if t is not None else None
                                                  for n, t in zip(names, texts)])
        now = {(workers[name][0], name) for name in names}
        for name, families in zip(names, parsed):
            self.worker_up.labels(workers[name][0], name).set(0 if families is None else 1)
        # A worker that left its pool (a role switch: the same name in the other pool, or not
        # a worker for the moment) leaves no series behind: a stale 0 would hold the
        # worker-down alert for as long as the gateway runs, a stale 1 count it twice.
        for gone in self._worker_series - now:
            self.worker_up.remove(*gone)
        self._worker_series = now
        if self.peers is None:
            own, peers = self.own_families(), []
        else:
            own = await self._publish(deadline_s)
            peers = await read_peers(self.peers, self.replica, self.replicas, deadline_s)
        fetched = list(WithoutCreated(self._fetch_registry).collect())
        return await asyncio.to_thread(_render, [own, *peers, fetched, *(f for f in parsed if f is not None)])

    def own_families(self) -> list[Metric]:
        """This replica's families (labelled with its rank when it has peers). Collected here, on
        the loop: the router and reliability collectors read the backend's state, which only the
        loop changes. The families are copies."""
        own = list(WithoutCreated(self.registry).collect())
        return labelled(own, self.replica) if self.replicas > 1 else own

    async def _publish(self, deadline_s: float = WORKER_SCRAPE_DEADLINE_S) -> list[Metric]:
        """Collect this replica's families and put them in the peers' store; returns them once
        they are there. A scrape shows its replica's own families only after publishing them:
        the next scrape, which HAProxy may send to another replica, reads them (or later ones)
        from the store. Shown fresh but published up to PUBLISH_S later, replica k's counters
        went back on every scrape that reached another replica after one that reached k (a
        counter reset to rate(): the whole count again as a spike). A store that does not answer
        within `deadline_s` is left to finish the put on its thread."""
        own = self.own_families()
        self._collected += 1
        seq = self._collected
        try:
            await in_store_thread(lambda: self._put_in_order(seq, own), deadline_s)
        except Exception as e:  # noqa: BLE001 - the GCS unreachable or hung: this scrape still has our own
            log.warning("publishing this gateway replica's metrics failed: %r", e)
        return own

    def _put_in_order(self, seq: int, own: list[Metric]) -> None:
        """Put `own` (collected `seq`th) unless later families are in the store already: the
        publisher's put and a scrape's may race, and the older must not overwrite the newer."""
        assert self.peers is not None
        with self._put_lock:
            if seq <= self._put_seq:
                return
            self.peers.put(self.replica, pack(_render([own]), time.time()))
            self._put_seq = seq

    def start_publishing(self) -> None:
        """With peers, publish this replica's families every PUBLISH_S (the app's startup)."""
        if self.peers is not None and self._publisher is None:
            self._publisher = asyncio.ensure_future(publish_forever(self._publish))

    async def close(self) -> None:
        await stop_publisher(self._publisher)
        self._publisher = None


PLANNER_DECISIONS = ("keep", "recommend", "applied", "failed", "skipped")


class PlannerMetrics:
    """What the planner loop (cluster/planner/role_loop.py) decided in its last window.
    Exported whether a planner runs or not (zeros then), like every gateway family."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.recommended = Gauge("pdserve:planner_recommended_workers",
                                 "Workers per pool the planner recommends for its last window's traffic",
                                 ["pool"], registry=registry)
        self.predicted = Gauge("pdserve:planner_predicted_slo_attainment",
                               "Predicted SLO attainment of the last window's traffic on the current split and on "
                               "the recommended one", ["split"], registry=registry)
        self.observed = Gauge("pdserve:planner_observed_slo_attainment",
                              "SLO attainment in the planner's last window, from the TTFT, TPOT and E2E histograms",
                              registry=registry)
        self.decisions = Counter("pdserve:planner_decisions", "Planner windows by outcome", ["decision"],
                                 registry=registry)
        for pool in ("prefill", "decode"):
            self.recommended.labels(pool)
        for split in ("current", "recommended"):
            self.predicted.labels(split)
        for d in PLANNER_DECISIONS:
            self.decisions.labels(d)

    def record(self, prefill: int, decode: int, current: float, recommended: float, observed: float | None) -> None:
        self.recommended.labels("prefill").set(prefill)
        self.recommended.labels("decode").set(decode)
        self.predicted.labels("current").set(current)
        self.predicted.labels("recommended").set(recommended)
        if observed is not None:
            self.observed.set(observed)


@dataclasses.dataclass
class _Timeline:
    """One choice's tokens as they reach the client."""

    first: float
    last: float
    tokens: int


class RequestMetrics:
    """One request's timeline at the gateway. Not thread-safe: the request's
    handler (one asyncio task) drives it. `close` runs on every exit.

    Each choice (n > 1, several prompts) is timed on its own, as vLLM times each
    of a request's n samples: TTFT, ITL, TPOT, end-to-end latency and generation
    tokens per choice. Choices interleaved in one timeline would divide TPOT by n
    and measure ITL from whichever choice spoke last."""

    def __init__(self, m: GatewayMetrics) -> None:
        self._m = m
        self.arrival = time.perf_counter()
        self._choices: dict[int, _Timeline] = {}
        self._choice_prompts: tuple[int, ...] = ()
        self._queue_seen: set[int] = set()  # the choices whose queue time is observed (vLLM's: per engine request)
        self._admitted = self._closed = False

    def admitted(self, prompt_tokens: int, choice_prompts: Iterable[int] | None = None) -> None:
        """`prompt_tokens` in all; `choice_prompts`: the prompt length of each choice, by index
        (None: one choice of them all)."""
        self._admitted = True
        self._choice_prompts = (prompt_tokens,) if choice_prompts is None else tuple(choice_prompts)
        self._m.queued.inc()
        self._m.prompt_tokens.inc(prompt_tokens)

    def output(self, out: RequestOutput, choice: int = 0, dropped: bool = False) -> None:
        """`out`'s tokens, of choice `choice`, are going to the client now (non-streaming: are ready to).
        `dropped`: none of them is (echo with max_tokens 0: the token the engine made is not sent,
        nor counted, as `usage` does not count it)."""
        m = self._m
        queue_s = out.metrics.get("queue_time_s")
        if queue_s is not None and choice not in self._queue_seen:  # once per choice: its first worker's queue
            self._queue_seen.add(choice)
            m.queue_time.observe(queue_s)
        n = 0 if dropped else len(out.outputs[0].token_ids)
        if not n:
            return
        now = time.perf_counter()
        m.generation_tokens.inc(n)
        c = self._choices.get(choice)
        if c is None:
            if not self._choices and self._admitted:
                m.queued.dec()  # the request's first token
            self._choices[choice] = _Timeline(now, now, n)
            m.ttft.observe(now - self.arrival)
            return
        gap = (now - c.last) / n
        for _ in range(n):
            m.itl.observe(gap)
        c.last = now
        c.tokens += n

    def succeeded(self, finish_reasons: Iterable[str | None]) -> None:
        m = self._m
        reasons = list(finish_reasons)
        for reason in reasons:
            m.success.labels(reason or "abort").inc()
        if self._admitted:
            # One observation per choice, of its own prompt, as request_generation_tokens and
            # request_success have: the planner pairs the two histograms' observations as one
            # engine request each (cluster/planner/traffic.py), and took a request's prompts
            # summed, observed once, for one request of their total length.
            for prompt_tokens in self._choice_prompts:
                m.request_prompt_tokens.observe(prompt_tokens)
            for _ in range(len(reasons) - len(self._choices)):  # choices that made no token
                m.request_generation_tokens.observe(0)
        for c in self._choices.values():
            if self._admitted:
                m.request_generation_tokens.observe(c.tokens)
            m.e2e.observe(c.last - self.arrival)
            if c.tokens >= 2:
                m.tpot.observe((c.last - c.first) / (c.tokens - 1))
        self.close()

    def failed(self, status: int) -> None:
        """An error the exception handlers do not see (one reported in-band, in the stream)."""
        if not self._closed:
            self._m.error(status)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._admitted and not self._choices:
            self._m.queued.dec()


class RequestCounter:
    """ASGI middleware counting responses into `pdserve:gateway_requests_total`
    by endpoint and status. Plain ASGI: it only looks at the response start, so
    streamed bodies pass through untouched (Starlette's BaseHTTPMiddleware would
    relay every chunk through a queue)."""

    def __init__(self, app: ASGIApp, counter: Counter, endpoints: frozenset[str],
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        # `headers`: what every response carries besides (the gateway replica's name), added here
        # because this wrapper sees every response start anyway: one wrapper fewer on each
        # streamed chunk's way out (docs/front-door.md).
        self.app, self.counter, self.endpoints, self.headers = app, counter, endpoints, list(headers)
        for endpoint in endpoints:  # series from the first scrape on
            counter.labels(endpoint, "200")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None  # until the app starts a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self.headers:
                    message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500  # it failed before it answered
            raise
        finally:
            # No response started and no failure: the app ended because the client went away
            # before one could be sent (499, nginx's "client closed request"), as while its body
            # was still coming: not the server's error.
            path = scope.get("path", "")
            self.counter.labels(path if path in self.endpoints else "other", str(status or 499)).inc()


async def _fetch(handle: WorkerHandle | None, deadline_s: float) -> str | None:
    if handle is None:
        return None
    try:
        async with asyncio.timeout(deadline_s):
            data = await handle.metrics.remote()
    except Exception as e:  # noqa: BLE001 - a dead, slow or broken worker is reported by worker_up
        log.debug("metrics fetch failed: %r", e)
        return None
    return data.decode()


def _parse(worker: str, text: str) -> list[Metric] | None:
    try:
        return list(text_string_to_metric_families(text))
    except Exception as e:  # noqa: BLE001 - one bad worker must not break the scrape
        log.warning("metrics of %s do not parse: %r", worker, e)
        return None


def _render(sources: list[list[Metric]]) -> bytes:
    """The families of every source merged by name, as one text exposition."""
    merged: dict[str, Metric] = {}
    for families in sources:
        _merge_into(merged, families)
    return generate_latest(_Families(list(merged.values())))


def _merge_into(merged: dict[str, Metric], families: Iterable[Metric]) -> None:
    """Add `families`' samples to `merged`, one family per name."""
    for fam in families:
        have = merged.get(fam.name)
        if have is None:
            copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            copy.samples = list(fam.samples)
            merged[fam.name] = copy
        elif have.type != fam.type:
            log.warning("metric %s is a %s here and a %s elsewhere; dropped", fam.name, fam.type, have.type)
        else:
            have.samples.extend(fam.samples)


class _Families:
    """Already-collected families, as something `generate_latest` renders."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class _RouterCollector:
    """`pdserve:router_*` from the router's own counters, every reason from the start."""

    def __init__(self, stats: Callable[[], RouterStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        decisions = CounterMetricFamily("pdserve:router_decisions",
                                        "Routing decisions by role and reason (disaggregated)",
                                        labels=["role", "reason"])
        for reason in RouteReason:
            decisions.add_metric(["prefill", reason.value], stats.decisions[reason] if stats else 0)
        for d_reason in DecodeReason:
            decisions.add_metric(["decode", d_reason.value], stats.decode_decisions[d_reason] if stats else 0)
        yield decisions
        # Both per placement: each of a request's n samples is placed alone, and so is each migrated
        # try (its prompt with the tokens it resumes from). The share cached is the one over the other,
        # not over pdserve:prompt_tokens (once per prompt, at admission: a share that passed 1 at n > 1).
        routed = CounterMetricFamily("pdserve:router_prompt_tokens",
                                     "Prompt tokens of the requests the router placed (each sample and try)")
        routed.add_metric([], stats.prompt_tokens if stats else 0)
        yield routed
        cached = CounterMetricFamily("pdserve:router_cached_prompt_tokens",
                                     "Of pdserve:router_prompt_tokens, those the chosen prefill worker already "
                                     "held (router's index)")
        cached.add_metric([], stats.cached_prompt_tokens if stats else 0)
        yield cached


# (family, help, `Reliability` field) of the gateway's failure and recovery counters.
_RELIABILITY_COUNTERS = (
    ("pdserve:request_migrations", "Tries started because the previous try's worker died or its token stream broke",
     "migrations"),
    ("pdserve:request_migration_resumed_tokens",
     "Output tokens that migrated tries did not send again (the client had them)", "resumed_tokens"),
    ("pdserve:request_migrations_exhausted", "Requests that failed after their last allowed try", "exhausted"),
    ("pdserve:requests_faulted", "Requests a worker's engine failed alone (their values or logits broke their row; "
     "never moved to another worker)", "faulted"),
    ("pdserve:workers_lost", "Workers that went from answering to not (a call or a poll failed)", "workers_lost"),
    ("pdserve:workers_readmitted", "Lost workers that answered again", "workers_readmitted"),
    ("pdserve:workers_restarted", "Workers that answered from a new process (restarted)", "workers_restarted"),
    ("pdserve:workers_stalled", "Workers given up on by the stall watch: they held work and made no progress "
     "for --stall-timeout (their requests moved; restarted)", "workers_stalled"),
    ("pdserve:token_stream_gaps", "Batches missing from a worker's token-stream sequence (its requests move on)",
     "stream_gaps"),
    ("pdserve:token_stream_stale_deltas", "Token deltas of tries given up on (dropped)", "stream_stale"),
    ("pdserve:token_stream_diverged",
     "Repeats of handed-on tokens that differed from them (each broke its try, which resumed)", "stream_diverged"),
    ("pdserve:token_stream_forged", "Token-stream messages whose MAC did not check (dropped unread)", "stream_forged"),
    ("pdserve:token_stream_replayed", "Signed token-stream batches sent again (refused)", "stream_replayed"),
    ("pdserve:role_switch_failures", "Role switches that failed (the worker kept, or went back to, its role)",
     "role_switch_failures"),
)


class _ReliabilityCollector:
    """The backend's `Reliability`: pools, health state, migrations, worker events, token-stream gaps."""

    def __init__(self, reliability: Callable[[], Reliability | None]) -> None:
        self._reliability = reliability

    def collect(self) -> Iterator[Metric]:
        r = self._reliability()
        live = GaugeMetricFamily("pdserve:pool_workers_live", "Workers of the pool the gateway routes to now",
                                 labels=["pool"])
        configured = GaugeMetricFamily("pdserve:pool_workers_configured",
                                       "Workers in the pool: as deployed, then as role switches moved them",
                                       labels=["pool"])
        state = GaugeMetricFamily("pdserve:health_state",
                                  "1 for the state /health reports (ok, degraded: a pool short of workers, "
                                  "unavailable: no request can be served), 0 for the others", labels=["state"])
        if r is not None:
            for pool, p in r.health.pools.items():
                live.add_metric([pool], p.live)
                configured.add_metric([pool], p.total)
            status = r.health.status
            for s in HEALTH_STATES:
                state.add_metric([s], float(s == status))
        yield live
        yield configured
        yield state

        for name, doc, field in _RELIABILITY_COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(r, field) if r is not None else 0)
            yield c
        switches = CounterMetricFamily("pdserve:role_switches",
                                       "Workers that changed role while serving, by the pool they joined",
                                       labels=["to_pool"])
        switches.add_metric(["prefill"], r.role_switches_to_prefill if r is not None else 0)
        switches.add_metric(["decode"], r.role_switches_to_decode if r is not None else 0)
        yield switches
