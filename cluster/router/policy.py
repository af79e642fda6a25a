"""Routing policy: pure functions from an immutable snapshot to a decision.

Nothing here holds state or does I/O; the `Router` builds a `RouterSnapshot`
from its prefix index and the latest load reports and keeps the one piece of
state a policy needs (the round-robin counter), passed in and handed back.

Cache-aware prefill cost, in *blocks of prefill work* (block_size tokens each):

    cost(P) = uncached_blocks(P) + w * queued_prefill_tokens(P) / block_size

`uncached_blocks` is what P would compute for this prompt after reusing its
prefix cache; the second term is the prefill work already queued ahead of it.
With w = 1 both terms are the same unit, so the cost estimates how much prefill
P must do before this request's first token (time to first token, if prefill
time is linear in tokens). w > 1 weighs queueing more (spread load, protect
tail TTFT); w < 1 weighs cache hits more. A cached worker therefore loses to an
idle cold one once w * queued / block_size exceeds the blocks its cache saves.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefills and decodes

    @property
    def can_prefill(self) -> bool:
        return self is not WorkerRole.DECODE

    @property
    def can_decode(self) -> bool:
        return self is not WorkerRole.PREFILL


class RoutingPolicy(enum.Enum):
    CACHE_AWARE = "cache_aware"  # prefill by cost (cache + queue), decode by room + load + prefix
    ROUND_ROBIN = "round_robin"  # the baseline: ignores caches and load (like vLLM's toy proxy)


class Plan(enum.Enum):
    """How a request runs, given where it prefills and decodes."""

    LOCAL = "local"  # the decode worker prefills it too: no transfer
    HANDOFF = "handoff"  # the prefill worker computes the prompt, its KV moves to the decode worker
    PREFILL_ONLY = "prefill_only"  # it ends at its first token: the prefill worker runs it alone


class RouteReason(enum.Enum):
    """Why the prompt is prefilled where it is."""

    CACHE_HIT = "cache_hit"  # the prefill worker with the longest cached prefix won on cost
    LOAD_OVER_CACHE = "load_over_cache"  # a worker with less cached won: the cached one is too queued
    COLD = "cold"  # no prefill worker caches any of the prompt; chosen by queue
    LOCAL_PREFILL = "local_prefill"  # the uncached part on the decode worker is short: it prefills itself
    NO_PREFILL_WORKER = "no_prefill_worker"  # no healthy prefill worker: decode prefills (degraded)
    PREFILL_BACKLOG = "prefill_backlog"  # every prefill worker is further behind than the decode worker
    ROUND_ROBIN = "round_robin"
    RESUMED = "resumed"  # a migrated request goes on: the decode worker computes prompt + output so far


class DecodeReason(enum.Enum):
    """Why the request decodes where it does."""

    PREFIX_AFFINITY = "prefix_affinity"  # among similarly loaded workers, it held the longest prefix
    LEAST_LOADED = "least_loaded"  # no similarly loaded worker held any of the prompt
    NO_ROOM = "no_room"  # no worker has room for prompt + headroom: the one with most free blocks
    ROUND_ROBIN = "round_robin"


class NoHealthyWorkerError(RuntimeError):
    """No healthy worker can take this role. The gateway answers 503."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no healthy {role} worker to route to")
        self.role = role


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker last reported about its load (one per worker)."""

    worker_id: str
    role: WorkerRole
    healthy: bool = True
    queued_prefill_tokens: int = 0  # prompt tokens waiting or mid-prefill, not yet computed
    running_requests: int = 0  # sequences in the decode batch
    free_blocks: int = 0  # KV blocks an allocation may take (incl. evictable cached ones)
    total_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.role, WorkerRole):
            raise TypeError(f"role: must be a WorkerRole, got {self.role!r}")
        for name in ("queued_prefill_tokens", "running_requests", "free_blocks", "total_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.free_blocks > self.total_blocks:
            raise ValueError(f"free_blocks: {self.free_blocks} exceeds total_blocks {self.total_blocks}")


@dataclass(frozen=True)
class RouterSnapshot:
    """Everything a routing decision reads, for one request at one moment."""

    prompt_tokens: int
    block_size: int
    matched_blocks: Mapping[str, int]  # worker -> leading prompt blocks it caches (absent: 0)
    loads: tuple[WorkerLoad, ...]
    # Hash of the prompt's first full block (None if it has none). Ties between
    # equally good workers go by rendezvous hashing on it, so a new prefix lands
    # on the same worker every time, even before that worker's STORED events
    # arrive, and different new prefixes spread over the workers.
    affinity_key: int | None = None
    max_tokens: int | None = None  # the request's (1: it ends at its first token)
    # (rank, replicas) of the gateway replica routing: where it has no affinity key to go by, each
    # replica breaks ties from a worker of its own (all from the first, they all picked it).
    replica: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ValueError(f"prompt_tokens: must be > 0, got {self.prompt_tokens}")
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be > 0, got {self.block_size}")
        ids = [load.worker_id for load in self.loads]
        if len(set(ids)) != len(ids):
            raise ValueError(f"loads: duplicate worker ids in {ids}")
        object.__setattr__(self, "matched_blocks", MappingProxyType(dict(self.matched_blocks)))
        object.__setattr__(self, "loads", tuple(sorted(self.loads, key=lambda load: load.worker_id)))

    @property
    def prompt_blocks(self) -> int:
        """Blocks the prompt fills, the last one possibly partial."""
        return -(-self.prompt_tokens // self.block_size)

    def cached_blocks(self, worker_id: str) -> int:
        """Prompt blocks the worker can reuse. A worker always computes at least
        the last prompt token (its logits give the first output token), so a
        full hit still leaves the last block to compute, as `KVCacheManager` does."""
        return min(self.matched_blocks.get(worker_id, 0), (self.prompt_tokens - 1) // self.block_size)

    def uncached_blocks(self, worker_id: str) -> int:
        return self.prompt_blocks - self.cached_blocks(worker_id)

    def uncached_tokens(self, worker_id: str) -> int:
        return self.prompt_tokens - self.cached_blocks(worker_id) * self.block_size

    def load(self, worker_id: str) -> WorkerLoad:
        (found,) = [load for load in self.loads if load.worker_id == worker_id]
        return found

    def tie_rank(self, worker_id: str) -> tuple[int, str]:
        """Last sort key between otherwise equal workers (rendezvous hashing)."""
        if self.affinity_key is None:
            role = self.load(worker_id).role
            peers = [load.worker_id for load in self.loads if load.role is role]
            rank, replicas = self.replica
            return (peers.index(worker_id) - rank * len(peers) // max(1, replicas)) % len(peers), worker_id
        digest = hashlib.blake2b(f"{self.affinity_key}:{worker_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little"), worker_id


@dataclass(frozen=True)
class PrefillCost:
    """One row of the cost table, in blocks of prefill work (see the module doc)."""

    worker_id: str
    uncached_blocks: int
    queued_blocks: float  # queued prefill tokens / block_size
    cost: float  # uncached_blocks + w * queued_blocks


@dataclass(frozen=True)
class RouterConfig:
    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    # w in the prefill cost. 1 would price a queued token like an uncached one
    # (the TTFT estimate), but a miss costs more than its own compute: the
    # prefix now lives on two workers and evicts others. On the shared-prefix
    # routing test (tests/cluster/test_serve_routing.py), weights below 1
    # computed fewer prompt tokens (runs: docs/cluster.md, "The load weight").
    load_weight: float = 0.5
    # Prefill on the decode worker, with no transfer, when fewer than this many
    # prompt tokens are uncached there. 0 turns it off (llm-d ships 8-16).
    local_prefill_threshold_tokens: int = 16
    # A decode worker needs free blocks for the prompt plus this many (output room).
    decode_headroom_blocks: int = 16
    # Decode workers whose running batch is within this of the smallest count as
    # equally loaded; among those the longest cached prefix wins.
    decode_load_slack: int = 2
    # With no healthy prefill worker, let the decode worker prefill (slower ITL
    # for its batch) instead of failing the request.
    fallback_local_prefill: bool = True
    # Conditional disaggregation (Dynamo's, on queue length): when the chosen prefill
    # worker has at least this many prompt tokens queued and the decode worker has fewer
    # (its own prefills, this prompt's included), the decode worker prefills. Why: where
    # prefill workers are slower to reach than decode workers have room (a small node,
    # a burst), waiting in their queue costs TTFT and starves the decode batch. 0: off.
    max_prefill_backlog_tokens: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RoutingPolicy):
            raise ValueError(f"policy: must be a RoutingPolicy, got {self.policy!r}")
        if not (math.isfinite(self.load_weight) and self.load_weight >= 0):
            raise ValueError(f"load_weight: must be a finite number >= 0, got {self.load_weight}")
        for name in ("local_prefill_threshold_tokens", "decode_headroom_blocks", "decode_load_slack",
                     "max_prefill_backlog_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class RoutingDecision:
    """Where one request prefills and decodes, why, and the numbers behind it."""

    prefill_worker: str | None  # None when the decode worker prefills (Plan.LOCAL)
    decode_worker: str  # under PREFILL_ONLY, where it runs if the prefill worker is gone
    plan: Plan
    reason: RouteReason
    decode_reason: DecodeReason
    detail: str
    # Prompt blocks the prefilling worker reuses, and those the decode worker
    # already holds (only the rest is transferred).
    prefill_cached_blocks: int
    decode_cached_blocks: int
    prompt_tokens: int
    block_size: int
    costs: tuple[PrefillCost, ...] = ()  # cheapest first; empty when no cost was computed
    next_rr_counter: int = 0  # round-robin state to pass to the next call

    @property
    def local_prefill(self) -> bool:
        """The decode worker prefills the uncached part; nothing is transferred."""
        return self.plan is Plan.LOCAL

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefilling worker takes from its cache instead of computing."""
        return self.prefill_cached_blocks * self.block_size

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the prefilling worker computes (the router's estimate)."""
        return self.prompt_tokens - self.cached_prompt_tokens

    @property
    def transferred_blocks(self) -> int:
        """Blocks sent prefill -> decode (the decode worker's own prefix is not sent)."""
        if self.plan is not Plan.HANDOFF:
            return 0
        return -(-self.prompt_tokens // self.block_size) - self.decode_cached_blocks


def choose_prefill(snapshot: RouterSnapshot, weight_w: float) -> tuple[str, RouteReason, tuple[PrefillCost, ...]]:
    """The healthy prefill-capable worker with the lowest cost (module doc).

    Ties go to the shorter queue, then `snapshot.tie_rank` (rendezvous on the
    prompt's first block, then worker id), so the same snapshot always gives
    the same answer. Raises NoHealthyWorkerError.
    """
    candidates = [load for load in snapshot.loads if load.healthy and load.role.can_prefill]
    if not candidates:
        raise NoHealthyWorkerError("prefill")
    rows = []
    for load in candidates:
        queued = load.queued_prefill_tokens / snapshot.block_size
        uncached = snapshot.uncached_blocks(load.worker_id)
        rows.append((PrefillCost(load.worker_id, uncached, queued, uncached + weight_w * queued), load))
    rows.sort(key=lambda r: (r[0].cost, r[1].queued_prefill_tokens, snapshot.tie_rank(r[0].worker_id)))
    costs = tuple(row for row, _ in rows)
    best, fewest_uncached = costs[0], min(c.uncached_blocks for c in costs)
    if fewest_uncached == snapshot.prompt_blocks:
        reason = RouteReason.COLD
    elif best.uncached_blocks == fewest_uncached:
        reason = RouteReason.CACHE_HIT
    else:
        reason = RouteReason.LOAD_OVER_CACHE
    return best.worker_id, reason, costs


def choose_decode(
    snapshot: RouterSnapshot, headroom_blocks: int = 0, load_slack: int = 0,
) -> tuple[str, DecodeReason]:
    """A healthy decode-capable worker with room for the prompt + headroom.

    Among those whose running batch is within `load_slack` of the smallest, the
    one holding the longest prefix of the prompt wins (only the rest is sent),
    then the smaller batch, the more free blocks, `snapshot.tie_rank`. If none has
    room, the one with the most free blocks (reason NO_ROOM: its scheduler will
    queue or preempt; the caller may prefer to hold the request instead).
    Raises NoHealthyWorkerError.
    """
    healthy = [load for load in snapshot.loads if load.healthy and load.role.can_decode]
    if not healthy:
        raise NoHealthyWorkerError("decode")
    need = snapshot.prompt_blocks + headroom_blocks
    fits = [load for load in healthy if load.free_blocks >= need]
    if not fits:
        # Ties as below (`tie_rank`): by id, every gateway replica sent its overflow to the same worker.
        best = min(healthy, key=lambda load: (-load.free_blocks, load.running_requests,
                                              snapshot.tie_rank(load.worker_id)))
        return best.worker_id, DecodeReason.NO_ROOM
    floor = min(load.running_requests for load in fits)
    similar = [load for load in fits if load.running_requests <= floor + load_slack]
    best = min(similar, key=lambda load: (
        -snapshot.cached_blocks(load.worker_id), load.running_requests, -load.free_blocks,
        snapshot.tie_rank(load.worker_id)))
    if snapshot.cached_blocks(best.worker_id) > 0:
        return best.worker_id, DecodeReason.PREFIX_AFFINITY
    return best.worker_id, DecodeReason.LEAST_LOADED


def choose_round_robin(
    snapshot: RouterSnapshot, counter: int, headroom_blocks: int = 0,
) -> tuple[str | None, str, int]:
    """(prefill worker or None if no healthy one, decode worker, next counter).

    Cycles over healthy workers in id order, ignoring caches and queues; decode
    skips workers without room for the prompt while any has room.
    """
    prefill = [load.worker_id for load in snapshot.loads if load.healthy and load.role.can_prefill]
    decode = [load for load in snapshot.loads if load.healthy and load.role.can_decode]
    if not decode:
        raise NoHealthyWorkerError("decode")
    need = snapshot.prompt_blocks + headroom_blocks
    decode = [load for load in decode if load.free_blocks >= need] or decode
    p = prefill[counter % len(prefill)] if prefill else None
    return p, decode[counter % len(decode)].worker_id, counter + 1


def route(snapshot: RouterSnapshot, config: RouterConfig, rr_counter: int = 0,
          local_only: bool = False) -> RoutingDecision:
    """Pick the decode worker first, then decide whether it prefills locally
    (uncached part there below the threshold, or no healthy prefill worker and
    the fallback is on) or which prefill worker computes and sends the KV; a
    request that ends at its first token then runs on that prefill worker alone.
    `local_only`: the decode worker computes it whatever the rest says (a resumed
    try: its first token is not the request's first).

    Raises NoHealthyWorkerError when no decode worker is healthy, or no prefill
    worker is and `config.fallback_local_prefill` is off.
    """
    rr_prefill: str | None = None
    if config.policy is RoutingPolicy.ROUND_ROBIN:
        rr_prefill, decode, rr_counter = choose_round_robin(snapshot, rr_counter, config.decode_headroom_blocks)
        decode_reason = DecodeReason.ROUND_ROBIN
    else:
        decode, decode_reason = choose_decode(snapshot, config.decode_headroom_blocks, config.decode_load_slack)
    local_uncached = snapshot.uncached_tokens(decode)
    costs: tuple[PrefillCost, ...] = ()
    prefill: str | None
    if local_only:
        prefill, reason, detail = None, RouteReason.RESUMED, f"resumed on {decode}"
    elif local_uncached < config.local_prefill_threshold_tokens:
        prefill, reason = None, RouteReason.LOCAL_PREFILL
        detail = f"{local_uncached} uncached tokens on {decode} < {config.local_prefill_threshold_tokens}"
    else:
        prefill, reason, detail, costs = _prefill_side(snapshot, config, rr_prefill, decode)
        if prefill is not None and prefill != decode and _backlogged(snapshot, config, prefill, decode, local_uncached):
            detail = (f"{prefill} has {snapshot.load(prefill).queued_prefill_tokens} prompt tokens queued, {decode} "
                      f"{snapshot.load(decode).queued_prefill_tokens} + {local_uncached}: {decode} prefills")
            prefill, reason = None, RouteReason.PREFILL_BACKLOG
    if prefill == decode:  # a colocated (BOTH) worker won both roles: nothing to transfer
        prefill, detail = None, f"{detail}; prefill worker is the decode worker"
    plan = (Plan.LOCAL if prefill is None else Plan.PREFILL_ONLY if snapshot.max_tokens == 1 and not local_only
            else Plan.HANDOFF)
    return RoutingDecision(
        prefill_worker=prefill, decode_worker=decode, plan=plan, reason=reason,
        decode_reason=decode_reason, detail=detail,
        prefill_cached_blocks=snapshot.cached_blocks(prefill if prefill is not None else decode),
        decode_cached_blocks=snapshot.cached_blocks(decode), prompt_tokens=snapshot.prompt_tokens,
        block_size=snapshot.block_size, costs=costs, next_rr_counter=rr_counter,
    )


def _backlogged(snapshot: RouterSnapshot, config: RouterConfig, prefill: str, decode: str, uncached: int) -> bool:
    """Whether the decode worker should prefill because `prefill` is further behind
    (RouterConfig.max_prefill_backlog_tokens)."""
    if not config.max_prefill_backlog_tokens:
        return False
    queued = snapshot.load(prefill).queued_prefill_tokens
    return queued >= config.max_prefill_backlog_tokens and \
        snapshot.load(decode).queued_prefill_tokens + uncached < queued


def _prefill_side(
    snapshot: RouterSnapshot, config: RouterConfig, rr_prefill: str | None, decode: str,
) -> tuple[str | None, RouteReason, str, tuple[PrefillCost, ...]]:
    """(prefill worker, reason, detail, costs); None means the decode worker prefills."""
    try:
        if config.policy is RoutingPolicy.ROUND_ROBIN:
            if rr_prefill is None:
                raise NoHealthyWorkerError("prefill")
            return rr_prefill, RouteReason.ROUND_ROBIN, f"round robin -> {rr_prefill}", ()
        prefill, reason, costs = choose_prefill(snapshot, config.load_weight)
        return prefill, reason, _cost_detail(costs), costs
    except NoHealthyWorkerError:
        if not config.fallback_local_prefill:
            raise
        return None, RouteReason.NO_PREFILL_WORKER, f"no healthy prefill worker: {decode} prefills", ()


def _cost_detail(costs: tuple[PrefillCost, ...]) -> str:
    def row(c: PrefillCost) -> str:
        return f"{c.worker_id}: {c.uncached_blocks} uncached + w*{c.queued_blocks:g} queued = {c.cost:g}"
    runner_up = f" (next {row(costs[1])})" if len(costs) > 1 else ""
    return row(costs[0]) + runner_up
