"""The router: prefix index + latest worker loads + a pure policy.

Mechanism only; every choice is made by `policy.route` over a snapshot. Not
thread-safe: one owner (the gateway's event loop or a router actor) calls it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.cluster.router.index import PrefixIndex
from pdserve.cluster.router.policy import (
    DecodeReason,
    Plan,
    RouterConfig,
    RouteReason,
    RouterSnapshot,
    RoutingDecision,
    WorkerLoad,
    route,
)
from pdserve.workers.kv.event_log import EventCursor
from pdserve.workers.kv.events import KVEvent
from pdserve.workers.kv.hashing import extend_block_hashes
from pdserve.workers.messages import KVEventBatch


@dataclass
class RouterStats:
    """Counters since the router started (exported as metrics by `cluster/`)."""

    decisions: Counter[RouteReason] = dataclasses.field(default_factory=Counter)  # where the prompt is prefilled
    decode_decisions: Counter[DecodeReason] = dataclasses.field(default_factory=Counter)  # where it decodes
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the chosen prefilling worker had cached (estimate)
    transferred_blocks: int = 0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Router:
    """Routes requests to (prefill, decode) workers.

    Callers feed it each worker's KV events (`on_kv_batch`: what the worker's
    `load(since=kv_cursor(worker))` returned; or `on_kv_events`, in emission
    order) and load reports (`update_load`, the latest replaces the previous),
    and call `forget_cache` when what a worker caches is unknown (it emptied its
    cache, changed role): that also drops its cursor, so the next poll brings a
    snapshot. `route` never blocks
    and raises `NoHealthyWorkerError` when no worker can take the request.

    Between load reports, `route` adds the request it just placed to the
    chosen workers' loads, so a burst does not all land on the worker that
    looked idle in the last report; the next `update_load` overwrites that.
    """

    def __init__(self, config: RouterConfig, block_size: int, index: PrefixIndex | None = None,
                 replica: tuple[int, int] = (0, 1)) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {block_size}")
        self.config = config
        self.block_size = block_size  # must equal the workers' KV block size, or no hash ever matches
        self.index = index if index is not None else PrefixIndex()
        self.loads: dict[str, WorkerLoad] = {}
        self.stats = RouterStats()
        # (rank, replicas) of this gateway replica: its round robin starts, and its ties without an
        # affinity key break, from a worker of its own (starting alike, the replicas all took the first).
        self.replica = replica
        self._rr_counter = replica[0]
        # Where the index stands in each worker's event log: kept with the index, so
        # whatever forgets a worker's cache also makes the next poll ask for a snapshot.
        self._kv_cursors: dict[str, EventCursor] = {}
        self._forgets: dict[str, int] = {}  # per worker: how many times its cache was forgotten

    def on_kv_events(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        self.index.apply_events(worker_id, events)

    def kv_cursor(self, worker_id: str) -> EventCursor | None:
        """What to ask the worker's `load` for: its events from here (None: a snapshot)."""
        return self._kv_cursors.get(worker_id)

    def kv_forgets(self, worker_id: str) -> int:
        """How many times the worker's cache was forgotten: read it when asking for a
        batch, and hand it back with the answer (`on_kv_batch`)."""
        return self._forgets.get(worker_id, 0)

    def on_kv_batch(self, worker_id: str, batch: KVEventBatch, forgets: int | None = None) -> None:
        """Apply a worker's events read from its log (a snapshot replaces what the index
        held for it) and stand at the batch's cursor. A batch is applied from where the
        index stands, whatever order replies come in (two polls of one worker in flight):
        the events it has applied already are skipped, a batch wholly behind it (or a
        snapshot older than it) changes nothing, and one that starts past it is left for
        the next poll, which asks from the index's cursor and so fills the gap. (Stood at a
        late reply's cursor, the index went back; a reply to a poll sent meanwhile then
        began past it, and the events in between were never read: a block the worker
        evicted stayed a hit.)
        `forgets`: `kv_forgets` when the batch was asked for. Events asked for before the
        cache was forgotten go on from a view no longer held: they are dropped, and the
        next poll asks for a snapshot (applied, they would set a cursor over the emptied
        view, and what the worker cached before them would never come back)."""
        if not batch.snapshot and forgets is not None and forgets != self.kv_forgets(worker_id):
            return
        at = self._kv_cursors.get(worker_id)
        # Where the index stands in this batch's log (None: it holds no view of that log).
        seq = at.seq if at is not None and at.log_id == batch.log_id else None
        if batch.snapshot:
            if seq is not None and batch.next_seq < seq:
                return
            self.index.replace_worker(worker_id, batch.events)
        else:
            # Events continue a view of their log: with none held (a reply from before the
            # worker's restart) there is nothing to apply them to.
            if seq is None or batch.next_seq <= seq or batch.first_seq > seq:
                return
            self.index.apply_events(worker_id, batch.events[seq - batch.first_seq:])
        self._kv_cursors[worker_id] = batch.cursor

    def update_load(self, load: WorkerLoad) -> None:
        self.loads[load.worker_id] = load

    def forget_cache(self, worker_id: str) -> None:
        """What the worker caches is unknown now: forget it; the next poll asks for a
        snapshot (`kv_cursor` is None), which rebuilds it."""
        self.index.remove_worker(worker_id)
        self._kv_cursors.pop(worker_id, None)
        self._forgets[worker_id] = self.kv_forgets(worker_id) + 1

    def snapshot(self, prompt_token_ids: Sequence[int], max_tokens: int | None = None,
                 cache_salt: str | None = None) -> tuple[RouterSnapshot, list[int]]:
        """The policy's input for this prompt, and the prompt's block hashes (salted
        as the workers salt the request's: `cache_salt` is its SamplingParams')."""
        hashes: list[int] = []
        extend_block_hashes(hashes, prompt_token_ids, self.block_size, cache_salt)
        snap = RouterSnapshot(
            prompt_tokens=len(prompt_token_ids), block_size=self.block_size,
            matched_blocks=self.index.match(hashes), loads=tuple(self.loads.values()),
            affinity_key=hashes[0] if hashes else None, max_tokens=max_tokens, replica=self.replica,
        )
        return snap, hashes

    def route(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int | None = None,
              cache_salt: str | None = None, avoid: str | None = None, local_only: bool = False) -> RoutingDecision:
        """`avoid`: a worker the request's last try failed on (alive, but it lost the try):
        routed around while another healthy worker can decode. `local_only`: the decode worker
        computes the prompt (a resumed try), charged and counted as such."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        snap, hashes = self.snapshot(prompt_token_ids, max_tokens, cache_salt)
        if avoid is not None:
            snap = _avoiding(snap, avoid)
        decision = route(snap, self.config, self._rr_counter, local_only)
        self._rr_counter = decision.next_rr_counter
        self._record(decision)
        self._account(decision, hashes)
        return decision

    def _record(self, decision: RoutingDecision) -> None:
        self.stats.decisions[decision.reason] += 1
        self.stats.decode_decisions[decision.decode_reason] += 1
        self.stats.prompt_tokens += decision.prompt_tokens
        self.stats.cached_prompt_tokens += decision.cached_prompt_tokens
        self.stats.transferred_blocks += decision.transferred_blocks

    def _account(self, decision: RoutingDecision, hashes: list[int]) -> None:
        """Refresh the reused prefix in the index (the worker's LRU does the same)
        and charge the request to the chosen workers until their next report."""
        prefiller = decision.prefill_worker or decision.decode_worker
        self.index.touch(prefiller, hashes[: decision.prefill_cached_blocks])
        load = self.loads[prefiller]
        self.loads[prefiller] = dataclasses.replace(
            load, queued_prefill_tokens=load.queued_prefill_tokens + decision.computed_prompt_tokens)
        if decision.plan is Plan.PREFILL_ONLY:
            return  # nothing reaches the decode worker
        if decision.plan is Plan.HANDOFF:
            self.index.touch(decision.decode_worker, hashes[: decision.decode_cached_blocks])
        load = self.loads[decision.decode_worker]
        new_blocks = -(-decision.prompt_tokens // self.block_size) - decision.decode_cached_blocks
        self.loads[decision.decode_worker] = dataclasses.replace(
            load, running_requests=load.running_requests + 1,
            free_blocks=max(0, load.free_blocks - new_blocks))


def _avoiding(snap: RouterSnapshot, worker: str) -> RouterSnapshot:
    """`snap` with `worker` taken for unhealthy, unless no other healthy worker can decode."""
    if not any(load.healthy and load.role.can_decode and load.worker_id != worker for load in snap.loads):
        return snap
    loads = tuple(dataclasses.replace(load, healthy=False) if load.worker_id == worker else load for load in snap.loads)
    return dataclasses.replace(snap, loads=loads)
