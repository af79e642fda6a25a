"""A discrete-event simulator of a pdserve cluster: a workload through a profile's costs.

The cluster, as the real one runs a request (cluster/disagg_backend.py, backend.py):

  colocated    the gateway sends it to the worker with the fewest requests in flight
               from it (ColocatedBackend); that worker prefills and decodes it.
  disaggregated  the router's own policy (cluster/router/policy.route, called here on a
               snapshot of the simulated workers: their cached prefixes, queued prefill
               tokens, running + waiting requests, free blocks) picks the decode worker and a plan:
    LOCAL         the decode worker prefills it too (little uncached there);
    PREFILL_ONLY  it ends at its first token: the prefill worker runs it alone;
    HANDOFF       the decode worker reserves blocks for the prompt (reusing its cache;
                  no room: it queues the request and prefills it itself, as
                  DecodeWorker.handoff does), the prefill worker computes the prompt
                  (chunked, from its own cache); the KV the decode worker lacks moves
                  over the (P, D) link as chunks complete (each chunk's full blocks,
                  behind what the link is already sending), the rest and the handoff's
                  fixed cost after the last chunk; the client has the first token when
                  the KV has landed, and the request joins the decode batch at the
                  next step.
  Each worker is `SimWorker` (sim_engine.py): the scheduler's policy over a KV pool.
  The gateway refuses a request when `max_in_flight` are in flight (429).

The host's cores, on a CPU profile (`CostModel.host`; a GPU profile's workers share
nothing): the profile times each worker's steps alone, one engine thread per worker on
cores of its own. Served, other CPU work runs on the same cores: each KV handoff's
sender thread (on the prefill worker's host) and receiver thread (MAC check, scatter:
on the decode worker's), each end costing the transfer's time, and the gateway,
HAProxy and a local client, `serving_cpu_per_token_s` per streamed token. That work
is free while a core is idle (fewer engine threads in a step than cores: the OS runs it
there); otherwise it is taken from the engines in a step, shared equally among them, as
a fair scheduler shares cores: a handoff's CPU becomes `debt` each busy worker pays at
its next step's start, a step's token streaming lengthens that step (its worker's share)
and the other busy workers' next steps (theirs). The cores are the profile machine's, or
as many as the workers' engine threads when there are more (the cluster is taken to run
on hosts like the profile's, with no core to spare).

Left out: the router's lag behind KV events and load reports (it sees the workers as
they are), the network between gateway and workers (but a fixed `dispatch_s`),
transfer failures and retries, stop strings and EOS (every request yields its
output_len).

`simulate(costs, engine, cluster, requests)` runs one configuration on one list of
requests and returns a `SimResult`.

Tensor parallelism: a worker of N ranks is one worker of N devices, with the costs and
engine settings of a profile measured at that size (`pools`: one per size the planner
has; a pool's workers take theirs). The cluster-wide parts (the link between workers, a
CPU host's cores) are the first profile's.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from pdserve.cluster.planner.costs import CostModel
from pdserve.cluster.planner.profile import Profile
from pdserve.cluster.planner.sim_engine import EngineSettings, Hooks, Seq, SeqKind, SimWorker, Track
from pdserve.cluster.planner.sim_workload import SimRequest
from pdserve.cluster.router.policy import (
    Plan,
    RouterConfig,
    RouterSnapshot,
    RoutingPolicy,
    WorkerLoad,
    WorkerRole,
    route,
)

DEFAULT_MAX_IN_FLIGHT = 256  # the gateway's admission bound (cluster/gateway.py)


@dataclass(frozen=True)
class ClusterShape:
    """P prefill + D decode workers, or N colocated ones, and how requests reach them."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    # Without conditional disaggregation (RouterConfig.max_prefill_backlog_tokens): the
    # planner sizes the pools so that prefill workers keep up on their own; the decode
    # workers' relief for a backlog is what serving does between its moves.
    router: RouterConfig = field(default_factory=lambda: RouterConfig(max_prefill_backlog_tokens=0))
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # Seconds from a request's send to its landing on the router (HTTP, tokenizing, the
    # gateway's hops): the profile times the workers only. It adds to every TTFT.
    dispatch_s: float = 0.0
    # Tensor-parallel ranks (devices) of each worker of a pool.
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError(f"cluster: worker counts must be >= 0, got {self}")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError("cluster: colocated workers or prefill + decode pools, not both")
        if not self.num_colocated and self.num_decode < 1:
            raise ValueError("cluster: needs >= 1 decode worker (or colocated workers)")
        if self.max_in_flight < 1:
            raise ValueError(f"cluster: max_in_flight must be >= 1, got {self.max_in_flight}")
        if not 0 <= self.dispatch_s < float("inf"):
            raise ValueError(f"cluster: dispatch_s must be finite and >= 0, got {self.dispatch_s}")
        if min(self.prefill_tp, self.decode_tp, self.colocated_tp) < 1:
            raise ValueError(f"cluster: tensor-parallel sizes must be >= 1, got {self}")

    @classmethod
    def colocated(cls, n: int, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, dispatch_s: float = 0.0,
                  tp: int = 1) -> ClusterShape:
        return cls(num_colocated=n, max_in_flight=max_in_flight, dispatch_s=dispatch_s, colocated_tp=tp)

    @classmethod
    def disaggregated(cls, p: int, d: int, policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE,
                      max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, dispatch_s: float = 0.0,
                      prefill_tp: int = 1, decode_tp: int = 1) -> ClusterShape:
        return cls(num_prefill=p, num_decode=d, router=RouterConfig(policy=policy, max_prefill_backlog_tokens=0),
                   max_in_flight=max_in_flight, dispatch_s=dispatch_s, prefill_tp=prefill_tp, decode_tp=decode_tp)

    @property
    def is_colocated(self) -> bool:
        return self.num_colocated > 0

    @property
    def num_workers(self) -> int:
        return self.num_colocated or self.num_prefill + self.num_decode

    @property
    def devices(self) -> int:
        """The devices (tensor-parallel ranks) of every worker together."""
        if self.is_colocated:
            return self.num_colocated * self.colocated_tp
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def label(self) -> str:
        """'1P+2D', '2 colocated'; a pool of more than one rank a worker says so: '1P(tp2)+2D'."""
        def tp(size: int) -> str:
            return f"(tp{size})" if size > 1 else ""

        if self.is_colocated:
            return f"{self.num_colocated} colocated{tp(self.colocated_tp)}"
        return f"{self.num_prefill}P{tp(self.prefill_tp)}+{self.num_decode}D{tp(self.decode_tp)}"

    def tp_of(self, role: WorkerRole) -> int:
        return {WorkerRole.PREFILL: self.prefill_tp, WorkerRole.DECODE: self.decode_tp}.get(role, self.colocated_tp)


def engine_settings(profile: Profile, **overrides: int | float | bool | None) -> EngineSettings:
    """The engine the profile was measured with (its speculative decoding included), with overrides."""
    e = profile.engine
    spec = profile.speculative
    base: dict[str, int | float | bool | None] = dict(
        block_size=e.block_size, max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        num_kv_blocks=e.num_kv_blocks, enable_prefix_caching=e.enable_prefix_caching, max_model_len=e.max_model_len,
        tokens_per_step=spec.tokens_per_step if spec is not None else 1.0,
        row_tokens=1 + spec.num_speculative_tokens if spec is not None else 1)
    unknown = set(overrides) - set(base)
    if unknown:
        raise ValueError(f"engine overrides: unknown settings {sorted(unknown)}")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return EngineSettings(**base)  # type: ignore[arg-type]


class _Event(enum.IntEnum):
    STEP_END = 0  # before an arrival at the same instant: the worker is free again
    TRANSFER_DONE = 1
    ARRIVAL = 2
    START = 3  # an idle worker starts its step once every arrival at that instant has landed


@dataclass
class SimResult:
    """One simulated run: every request's track, and what the workers did."""

    cluster: ClusterShape
    tracks: list[Track]
    busy_s: dict[str, float]  # worker -> seconds it was computing
    preemptions: int
    plans: dict[str, int]  # how many requests ran under each plan
    events: int
    blocks_held: dict[str, int] = field(default_factory=dict)  # worker -> blocks still held at the end (0: no leak)

    @property
    def duration(self) -> float:
        """First arrival to the last token (the bench's run duration)."""
        ends = [t.done for t in self.tracks if t.done is not None]
        return max(ends) - min(t.req.arrival for t in self.tracks) if ends else 0.0


@dataclass
class _Handoff:
    prefill: SimWorker
    decode: SimWorker
    sent: int  # prompt tokens whose KV the decode worker has or is being sent (its own cache first)


Pools = Mapping[int, tuple[CostModel, EngineSettings]]  # tensor-parallel size -> its profile's costs and engine


class _Cluster(Hooks):
    def __init__(self, costs: CostModel, engine: EngineSettings, shape: ClusterShape, pools: Pools) -> None:
        self.costs, self.engine, self.shape = costs, engine, shape
        if shape.is_colocated:
            specs = [(f"worker-{i}", WorkerRole.BOTH) for i in range(shape.num_colocated)]
        else:
            specs = [(f"prefill-{i}", WorkerRole.PREFILL) for i in range(shape.num_prefill)]
            specs += [(f"decode-{i}", WorkerRole.DECODE) for i in range(shape.num_decode)]

        def worker(wid: str, role: WorkerRole) -> SimWorker:
            size = shape.tp_of(role)
            if size not in pools and size != 1:
                raise ValueError(f"cluster {shape.label}: no profile of a worker of {size} tensor-parallel ranks")
            its_costs, its_engine = pools.get(size, (costs, engine))
            return SimWorker(wid, role, its_engine, its_costs, self)

        self.workers = [worker(wid, role) for wid, role in specs]
        self.by_id = {w.wid: w for w in self.workers}
        self.heap: list[tuple[float, int, int, object]] = []
        self.counter = 0
        self.in_flight: dict[Track, SimWorker] = {}  # the colocated gateway's count per worker
        self.per_worker = {w.wid: 0 for w in self.workers}
        self.handoffs: dict[Seq, _Handoff] = {}  # by the prefill order
        self.link_free: dict[tuple[str, str], float] = {}
        self.rr_counter = 0
        self.plans: dict[str, int] = {}
        host = costs.host
        self.cores = max(host.cores, host.worker_threads * len(self.workers)) if host is not None else 0

    def push(self, t: float, kind: _Event, payload: object) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, kind, self.counter, payload))

    # -- Hooks -------------------------------------------------------------------------

    def wake(self, worker: SimWorker, t: float) -> None:
        self.push(t, _Event.STEP_END, (worker, worker.version))

    def kick(self, worker: SimWorker, t: float) -> None:
        self.push(t, _Event.START, worker)

    def chunk_done(self, seq: Seq, t: float) -> None:
        """The full blocks computed so far leave now, behind what the link is already sending."""
        h = self.handoffs[seq]
        full = seq.computed // self.engine.block_size * self.engine.block_size
        if full > h.sent:
            self._send(h, t, self.costs.transfer_bytes_s(full - h.sent))
            h.sent = full

    def prefill_done(self, seq: Seq, t: float) -> None:
        """The rest of the KV leaves, then the fixed part of a handoff (verification, the reply)."""
        h = self.handoffs[seq]
        end = self._send(h, t, self.costs.transfer_s(max(0, seq.req.prompt_len - h.sent)))
        self.push(end, _Event.TRANSFER_DONE, seq)

    def _send(self, h: _Handoff, t: float, seconds: float) -> float:
        link = (h.prefill.wid, h.decode.wid)
        end = max(t, self.link_free.get(link, 0.0)) + seconds
        self.link_free[link] = end
        host = self.costs.host
        if host is not None and host.transfer_cpu:
            # the sender's and the receiver's threads, each busy for the transfer's time,
            # charged as the send is queued (the cores' state then stands for the transfer's)
            self.charge(2 * seconds)
        return end

    def stream_cpu(self, worker: SimWorker, per_step: float, steps: int) -> float:
        others = self._contended(worker)
        if others is None:
            return 0.0
        share = per_step / (len(others) + 1)
        for w in others:
            w.debt += share * steps
        return share

    def charge(self, seconds: float) -> None:
        """CPU work outside the engines (a KV handoff's thread): free if a core is idle,
        else split among the workers holding the cores, paid at their next steps."""
        busy = [w for w in self.workers if w.busy]
        if not busy or self._idle_cores(len(busy)) >= 1:
            return
        for w in busy:
            w.debt += seconds / len(busy)

    def _contended(self, worker: SimWorker) -> list[SimWorker] | None:
        """The other busy workers when `worker`'s step leaves no core idle, else None."""
        others = [w for w in self.workers if w is not worker and w.busy]
        return others if self._idle_cores(len(others) + 1) < 1 else None

    def _idle_cores(self, busy_workers: int) -> int:
        assert self.costs.host is not None
        return self.cores - busy_workers * self.costs.host.worker_threads

    def finished(self, track: Track, t: float) -> None:
        track.done = t
        w = self.in_flight.pop(track, None)
        if w is not None:
            self.per_worker[w.wid] -= 1

    # -- events ----------------------------------------------------------------------------

    def transfer_done(self, seq: Seq, t: float) -> None:
        h = self.handoffs.pop(seq)
        h.prefill.release_held(seq, t)
        peer = seq.peer
        assert peer is not None
        seq.track.emit(t)  # the first token reaches the client once its KV is on the decode worker
        peer.generated = 1.0
        h.decode.kv_arrived(peer, t)

    def arrive(self, req: SimRequest, track: Track, t: float) -> None:
        mml = self.engine.max_model_len
        if mml is not None and req.prompt_len + req.output_len > mml:
            self._refuse(track, "too_long", f"HTTP 400: prompt + max_tokens over max_model_len {mml} (simulated)")
            return
        if len(self.in_flight) >= self.shape.max_in_flight:
            self._refuse(track, "rejected", "HTTP 429: server is at capacity (simulated admission bound)")
            return
        if self.shape.is_colocated:
            w = min(self.workers, key=lambda x: self.per_worker[x.wid])  # fewest in flight, then index
            self._place(track, w)
            track.plan = "colocated"
            self._count(track.plan)
            w.enqueue(Seq(track, SeqKind.FULL, req.prompt_len), t)
            return
        self._route(req, track, t)

    def _route(self, req: SimRequest, track: Track, t: float) -> None:
        # A worker's requests as the gateway's reports count them (disagg_backend: running + waiting,
        # where waiting holds reservations whose KV has not landed, landed ones the batch has no room
        # for yet, and queued prompts): without `waiting`, a worker with a queue looked as loaded as
        # one with none.
        loads = tuple(WorkerLoad(w.wid, w.role, True, w.queued_prefill,
                                 len(w.running) + len(w.waiting) + w.awaiting_kv, w.free_blocks(), w.pool.num_blocks)
                      for w in self.workers)
        matched = {w.wid: m for w in self.workers if (m := w.matched_blocks(req))}
        snap = RouterSnapshot(req.prompt_len, self.engine.block_size, matched, loads, req.affinity_key,
                              req.output_len)
        decision = route(snap, self.shape.router, self.rr_counter)
        self.rr_counter = decision.next_rr_counter
        d = self.by_id[decision.decode_worker]
        if decision.plan is Plan.PREFILL_ONLY:
            assert decision.prefill_worker is not None
            p = self.by_id[decision.prefill_worker]
            self._place(track, p)
            track.plan = Plan.PREFILL_ONLY.value
            p.enqueue(Seq(track, SeqKind.FULL, req.prompt_len), t)
        elif decision.plan is Plan.LOCAL:
            self._place(track, d)
            track.plan = Plan.LOCAL.value
            d.enqueue(Seq(track, SeqKind.FULL, req.prompt_len), t)
        else:
            assert decision.prefill_worker is not None
            self._handoff(track, self.by_id[decision.prefill_worker], d, t)
        self._count(track.plan)

    def _handoff(self, track: Track, p: SimWorker, d: SimWorker, t: float) -> None:
        req = track.req
        self._place(track, d)
        remote = Seq(track, SeqKind.REMOTE, req.prompt_len)
        cached = d.reserve(remote, t)
        if cached is None:  # no room to reserve: the decode worker queues it and prefills it
            track.plan = "local_no_room"
            remote.kind = SeqKind.FULL
            d.enqueue(remote, t)
            return
        track.plan = Plan.HANDOFF.value
        order = Seq(track, SeqKind.PREFILL_ORDER, req.prompt_len, peer=remote)
        self.handoffs[order] = _Handoff(p, d, cached)
        p.enqueue(order, t)

    def _refuse(self, track: Track, plan: str, why: str) -> None:
        track.rejected, track.plan = why, plan
        self._count(plan)

    def _place(self, track: Track, w: SimWorker) -> None:
        self.in_flight[track] = w
        self.per_worker[w.wid] += 1

    def _count(self, plan: str) -> None:
        self.plans[plan] = self.plans.get(plan, 0) + 1


def simulate(costs: CostModel, engine: EngineSettings, cluster: ClusterShape,
             requests: list[SimRequest], pools: Pools | None = None) -> SimResult:
    """Run `requests` (sent at their `arrival` times) through `cluster`; every request's track.
    `pools`: the costs and engine of a worker of each tensor-parallel size (default: `costs` and
    `engine` for one rank, the only size then).

    A request that never finishes (e.g. a prompt larger than a worker's KV pool) keeps
    `done` None and counts as failed."""
    c = _Cluster(costs, engine, cluster, pools or {})
    tracks = [Track(r) for r in requests]
    for r, tr in zip(requests, tracks):
        c.push(r.arrival + cluster.dispatch_s, _Event.ARRIVAL, tr)
    # every request makes a bounded number of events (its steps, its cuts of segments)
    limit = 10_000_000 + 100_000 * len(requests)
    events = 0
    while c.heap:
        events += 1
        if events > limit:
            raise RuntimeError(f"simulation: over {limit} events; a livelock in the model")
        t, kind, _, payload = heapq.heappop(c.heap)
        if kind == _Event.STEP_END:
            worker, version = cast(tuple[SimWorker, int], payload)
            worker.step_end(t, version)
        elif kind == _Event.START:
            cast(SimWorker, payload).kicked(t)
        elif kind == _Event.TRANSFER_DONE:
            c.transfer_done(cast(Seq, payload), t)
        else:
            track = cast(Track, payload)
            c.arrive(track.req, track, t)
    return SimResult(cluster, tracks, {w.wid: w.busy_s for w in c.workers},
                     sum(w.preemptions for w in c.workers), c.plans, events,
                     {w.wid: w.pool.private + len(w.pool.refs) for w in c.workers})
