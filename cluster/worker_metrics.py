"""One worker's Prometheus metrics (its own registry), labelled by pool and worker name.

Four feeds, each on the thread that owns its data:
  * engine steps: `observe_step` is one of the engine's step observers (engine thread);
  * KV transfers: `on_handoff` / `on_failure` (a `TransferRecorder`), from the
    transport's caller (the engine thread) or the decode worker;
  * engine counters and gauges: `sample(engine)` copies them into an immutable
    `EngineSnapshot`; the owner runs it on the engine thread (`AsyncEngine.call`)
    just before rendering, so nothing here reads the scheduler's lists while
    the scheduler changes them;
  * the worker's failure counters (leases expired, KV links lost, orphans
    aborted, ...): `counts()`, a callable the owner gives, read at render time
    (the counters are plain ints and locked properties, safe to read anywhere).
`render()` may run on any thread: it reads the last sample and the
prometheus_client metrics (which lock their own values).

It lives in cluster/: the engine it observes does not import Prometheus, so
workers/ stays runnable without it. Names and semantics are the metric
contract the dashboards and alert rules are written against (deploy/); every
label set exists from the first scrape.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.workers.cpu_lending import CpuLending
from pdserve.workers.cpu_turns import CpuTurns
from pdserve.workers.messages import FailReason
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.transfer.auth import RefusalCounts

if TYPE_CHECKING:
    from pdserve.workers.engine import LLMEngine
    from pdserve.workers.stats import StepStats

# Up to a long prompt's unchunked prefill (a 64k context), and a CPU step of one (seconds): a step
# past the last finite bound shows in a quantile as that bound.
PREFILL_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # a GPU's max_num_seqs reaches 1024
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Up to the default --transfer-timeout (30 s): a slow link's p99 reads as itself, not as 5 s.
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LABELS = ("pool", "worker")


class Pool(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class WorkerCounts:
    """A worker's own failure and recovery counters (0 where its role has none)."""

    awaiting_kv: int = 0  # decode: requests whose KV its receiver awaits (registered, not released)
    leases_expired: int = 0  # decode: reservations released because their KV did not come in time
    orphans_aborted: int = 0  # requests aborted because their gateway was gone
    link_resyncs: int = 0  # prefill: KV links that came back after a loss (credits granted anew)
    links_lost: int = 0  # prefill: KV links to decode workers lost after they were up
    # What its data-plane sockets refused from peers (workers/transfer/auth.py): decode from senders,
    # prefill from receivers.
    dataplane_refused: RefusalCounts = field(default_factory=RefusalCounts)
    # What its request inbox refused (cluster/worker_inbox.py): forged, replayed, malformed.
    inbox_refused: tuple[int, int, int] = (0, 0, 0)


class WorkerMetrics:
    """The registry of one worker. `num_speculative_tokens` fixes the draft
    positions exported from the start (k; more appear if the engine drafts more).
    `counts` returns the worker's failure counters at render time (default: zeros)."""

    def __init__(self, pool: Pool, worker: str, num_speculative_tokens: int = 0,
                 counts: Callable[[], WorkerCounts] = WorkerCounts) -> None:
        self.pool, self.worker = Pool(pool), worker
        self.counts = counts
        self.registry = CollectorRegistry()
        self._sample = EngineSnapshot()
        # The engine's CPU turns or lending (workers/cpu_turns.py, cpu_lending.py), if it takes or lends.
        self._turns: dict[str, float] = {}
        self._positions = num_speculative_tokens
        labels = (self.pool.value, worker)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*labels)

        self._prefill_tokens = hist("pdserve:iteration_prefill_tokens",
                                    "Prompt tokens computed per engine step (steps that computed any)",
                                    PREFILL_TOKEN_BUCKETS)
        self._decode_batch = hist("pdserve:iteration_decode_batch_size",
                                  "Sequences decoding (or verifying drafts) per engine step (steps with any)",
                                  DECODE_BATCH_BUCKETS)
        self._step_seconds = hist("pdserve:engine_step_duration_seconds",
                                  "Wall time of engine steps that ran the model", STEP_SECONDS_BUCKETS)
        self._transfer_seconds = hist("pdserve:kv_transfer_duration_seconds",
                                      "Per request handoff on the sending side: first KV send to the receiver's "
                                      "verified DONE", TRANSFER_SECONDS_BUCKETS)
        self._transfer_bytes = Counter("pdserve:kv_transfer_bytes", "K/V bytes sent to decode workers (sending side)",
                                       LABELS, registry=self.registry).labels(*labels)
        failures = Counter("pdserve:kv_transfer_failures", "KV transfers failed, by kind, on the side that saw it",
                           (*LABELS, "kind"), registry=self.registry)
        self._failures = {r.value: failures.labels(*labels, r.value) for r in FailReason}
        self._failures_family = failures
        self.registry.register(_EngineCollector(self))

    # -- feeds -----------------------------------------------------------------

    def attach(self, engine: LLMEngine) -> None:
        """Observe the engine's steps. Call before its thread starts stepping."""
        engine.step_observers.append(self.observe_step)

    def observe_step(self, step: StepStats) -> None:
        self._step_seconds.observe(step.duration_s)
        if step.prefill_tokens:
            self._prefill_tokens.observe(step.prefill_tokens)
        if step.decode_seqs:
            self._decode_batch.observe(step.decode_seqs)

    def on_handoff(self, nbytes: int, duration_s: float) -> None:
        self._transfer_bytes.inc(nbytes)
        self._transfer_seconds.observe(duration_s)

    def on_failure(self, kind: str) -> None:
        child = self._failures.get(kind)
        if child is None:  # a kind this version did not pre-create: still counted
            child = self._failures[kind] = self._failures_family.labels(self.pool.value, self.worker, kind)
        child.inc()

    def carry(self, before: WorkerMetrics) -> WorkerMetrics:
        """Start from `before`'s last reading of the engine (a role switch's new registry): its
        lifetime counters read 0 until the first sample otherwise, and a scrape in between (an
        engine step longer than the sample's wait) made them fall to 0 and jump back, which
        rate() counts as the engine's whole life happening at once."""
        self._sample, self._turns = before._sample, dict(before._turns)
        return self

    def sample(self, engine: LLMEngine) -> None:
        """Engine thread: refresh the counters and gauges `render` exports."""
        self._sample = engine.snapshot()
        if isinstance(engine.cpu_turn, CpuTurns | CpuLending):
            self._turns = engine.cpu_turn.stats()

    # -- output ----------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition of this worker's metrics."""
        return generate_latest(WithoutCreated(self.registry))


class _EngineCollector:
    """Exports the last `EngineSnapshot` (counters are the engine's own monotonic totals)
    and the worker's `WorkerCounts` now."""

    def __init__(self, owner: WorkerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        o, s = self._owner, self._owner._sample
        labels = [o.pool.value, o.worker]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        yield gauge("pdserve:kv_cache_usage_perc", "KV cache usage (0..1): used blocks / total blocks", s.kv_usage)
        yield gauge("pdserve:num_requests_running", "Requests in the running batch", s.running)
        yield gauge("pdserve:num_requests_waiting", "Requests queued (decode: including those awaiting their KV)",
                    s.waiting)
        yield counter("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prompt_tokens)
        yield counter("pdserve:prefix_cache_hits", "Prompt tokens served from the prefix cache", s.prompt_tokens_cached)
        yield counter("pdserve:num_preemptions", "Requests preempted (blocks freed, recomputed later)", s.preemptions)
        yield counter("pdserve:spec_decode_num_drafts", "Speculative verification passes", s.spec_drafts)
        yield counter("pdserve:spec_decode_num_draft_tokens", "Draft tokens proposed for verification",
                      s.spec_draft_tokens)
        yield counter("pdserve:spec_decode_num_accepted_tokens", "Draft tokens the target accepted",
                      s.spec_accepted_tokens)
        per_pos = CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position (0: first draft)",
                                      labels=(*LABELS, "position"))
        accepted = s.spec_accepted_per_position
        for i in range(max(o._positions, len(accepted))):
            per_pos.add_metric([*labels, str(i)], accepted[i] if i < len(accepted) else 0)
        yield per_pos

        yield counter("pdserve:structured_output_requests", "Requests whose output a grammar constrains "
                      "(a JSON schema, regex, choice or EBNF grammar)", s.constrained_requests)
        yield counter("pdserve:grammar_compiles", "Grammars compiled (a request's was not cached)", s.grammar_compiles)
        yield counter("pdserve:grammar_compile_seconds", "Seconds spent compiling grammars (on the compile thread)",
                      s.grammar_compile_s)
        yield counter("pdserve:grammar_cache_hits", "Constrained requests whose grammar was compiled already",
                      s.grammar_cache_hits)
        yield counter("pdserve:grammar_mask_seconds", "Seconds the engine thread spent filling and applying "
                      "grammars' token bitmasks", s.grammar_mask_s)
        yield counter("pdserve:cpu_turn_wait_seconds", "Seconds the engine waited for its turn at the node's cores "
                      "(CPU workers in turns), or for a neighbour's wide step to end (lending); 0 otherwise",
                      o._turns.get("waited_s", 0.0))
        yield counter("pdserve:cpu_turns_missed", "Engine steps run without their turn (or lock, lending): none came "
                      "within the deadline (a stuck worker on the node)", o._turns.get("missed", 0))
        yield counter("pdserve:cpu_wide_steps", "Engine steps run on all the node's cores while its other workers "
                      "were idle (CPU workers lending; 0 otherwise)", o._turns.get("wide_steps", 0))

        c = o.counts()
        yield gauge("pdserve:num_requests_awaiting_kv",
                    "Decode: requests whose KV from a prefill worker has not all arrived yet", c.awaiting_kv)
        yield counter("pdserve:kv_leases_expired",
                      "Decode: reserved blocks released because their KV did not come within the remote prefill's "
                      "budget", c.leases_expired)
        yield counter("pdserve:orphan_requests_aborted", "Requests aborted because their gateway was gone",
                      c.orphans_aborted)
        yield counter("pdserve:kv_link_resyncs", "Prefill: KV links to decode workers that came back after a loss",
                      c.link_resyncs)
        yield counter("pdserve:kv_links_lost", "Prefill: KV links to decode workers lost after they were up "
                      "(their pending transfers fail with peer_lost)", c.links_lost)
        refused = CounterMetricFamily("pdserve:dataplane_refused",
                                      "KV-link messages refused from peers, by reason: forged (no or wrong MAC), "
                                      "replayed, wrong_model (hello from another model); dropped: connections "
                                      "the socket lost (an oversize frame drops one)", labels=(*LABELS, "reason"))
        r = c.dataplane_refused
        for reason, value in (("forged", r.forged), ("replayed", r.replayed), ("wrong_model", r.wrong_model),
                              ("dropped", r.dropped)):
            refused.add_metric([*labels, reason], value)
        yield refused
        inbox = CounterMetricFamily("pdserve:inbox_refused",
                                    "Request starts and aborts the worker's inbox refused, by reason: forged (no or "
                                    "wrong MAC), replayed, malformed (signed, but no valid message)",
                                    labels=(*LABELS, "reason"))
        for reason, value in zip(("forged", "replayed", "malformed"), c.inbox_refused, strict=True):
            inbox.add_metric([*labels, reason], value)
        yield inbox


class WithoutCreated:
    """A view of a registry without prometheus_client's `*_created` samples:
    they are not in the contract, and would double the series of every counter."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for m in self._registry.collect():
            clean = Metric(m.name, m.documentation, m.type, m.unit)
            clean.samples = [s for s in m.samples if not s.name.endswith("_created")]
            yield clean
