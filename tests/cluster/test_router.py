"""Router: the prefix index fed by KV events, the pure routing policy, the Router
that composes them, and a no-model simulation of cache-aware vs round-robin."""

from __future__ import annotations

import random

import pytest

from pdserve.cluster.router import (
    DecodeReason,
    NoHealthyWorkerError,
    Plan,
    PrefixIndex,
    Router,
    RouterConfig,
    RouteReason,
    RouterSnapshot,
    RoutingPolicy,
    WorkerLoad,
    WorkerRole,
    choose_decode,
    choose_prefill,
    choose_round_robin,
    route,
)
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.kv.events import KVEvent, KVEventKind
from pdserve.workers.kv.hashing import ROOT_HASH, extend_block_hashes
from pdserve.workers.request import Request
from pdserve.workers.sampling_params import SamplingParams

BS = 16


def stored(*hashes: int) -> list[KVEvent]:
    return [KVEvent(KVEventKind.STORED, h) for h in hashes]


def removed(*hashes: int) -> list[KVEvent]:
    return [KVEvent(KVEventKind.REMOVED, h) for h in hashes]


def prefill_load(worker_id: str, **kw: object) -> WorkerLoad:
    fields: dict[str, object] = dict(free_blocks=1000, total_blocks=1000)
    fields.update(kw)
    return WorkerLoad(worker_id, WorkerRole.PREFILL, **fields)  # type: ignore[arg-type]


def decode_load(worker_id: str, **kw: object) -> WorkerLoad:
    fields: dict[str, object] = dict(free_blocks=1000, total_blocks=1000)
    fields.update(kw)
    return WorkerLoad(worker_id, WorkerRole.DECODE, **fields)  # type: ignore[arg-type]


def snapshot(prompt_tokens: int, matched: dict[str, int], *loads: WorkerLoad, key: int | None = None) -> RouterSnapshot:
    return RouterSnapshot(prompt_tokens, BS, matched, loads, affinity_key=key)


def block_hashes(tokens: list[int]) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BS)
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- index ----------------------------------------------------------------

def test_index_follows_stored_and_removed_events() -> None:
    index = PrefixIndex()
    index.apply_events("w0", stored(1, 2, 3))
    assert index.match([1, 2, 3, 4]) == {"w0": 3}
    index.apply_events("w0", removed(3))
    assert index.match([1, 2, 3, 4]) == {"w0": 2}
    index.apply_events("w0", removed(1, 99))  # an unknown REMOVED is ignored
    assert index.match([1, 2, 3]) == {}
    assert index.num_blocks("w0") == 1


def test_match_stops_at_the_first_gap_per_worker() -> None:
    index = PrefixIndex()
    index.apply_events("w0", stored(1, 2, 4, 5))  # block 3 missing
    index.apply_events("w1", stored(1, 2, 3, 4, 5))
    index.apply_events("w2", stored(2, 3, 4))  # no first block: no prefix at all
    assert index.match([1, 2, 3, 4, 5]) == {"w0": 2, "w1": 5}
    assert index.match([9, 2, 3]) == {}
    assert index.match([]) == {}


def test_index_matches_what_a_worker_pool_reports() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS, record_events=True)
    tokens = list(range(100))
    request = Request("r", tokens, SamplingParams(max_tokens=1), max_tokens=1)
    assert kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    index = PrefixIndex()
    index.apply_events("w0", kv.pool.take_events())
    hashes = block_hashes(tokens + [7] * 40)
    assert index.match(hashes) == {"w0": 100 // BS}


def test_removing_a_worker_clears_its_entries_only() -> None:
    index = PrefixIndex()
    index.apply_events("w0", stored(1, 2))
    index.apply_events("w1", stored(1, 2, 3))
    index.remove_worker("w1")
    assert index.match([1, 2, 3]) == {"w0": 2}
    assert index.num_blocks() == 2 and index.workers == ["w0"]
    index.apply_events("w1", stored(1))  # restarted, reports afresh
    assert index.match([1, 2, 3]) == {"w0": 2, "w1": 1}


def test_memory_cap_evicts_the_oldest_entries() -> None:
    index = PrefixIndex(max_blocks_per_worker=64)
    index.apply_events("w0", stored(*range(1, 1001)))  # e.g. every REMOVED was lost
    assert index.num_blocks("w0") == 64 and index.num_blocks() == 64
    assert index.match([1]) == {}
    assert index.match([1000]) == {"w0": 1}
    index.touch("w0", [937])  # the oldest, now just used: survives the next insert
    index.apply_events("w0", stored(2000))
    assert index.holds("w0", 937) and not index.holds("w0", 938)
    assert index.num_blocks("w0") == 64


def test_ttl_expires_entries_unless_touched() -> None:
    clock = FakeClock()
    index = PrefixIndex(ttl_s=10.0, clock=clock)
    index.apply_events("w0", stored(1, 2, 3))
    clock.now = 8.0
    index.touch("w0", [1])
    clock.now = 12.0
    assert index.match([1, 2, 3]) == {"w0": 1}  # 2 and 3 expired: stale entries never match
    index.expire()
    assert index.num_blocks("w0") == 1
    clock.now = 30.0
    assert index.match([1]) == {}


@pytest.mark.parametrize("kw", [dict(max_blocks_per_worker=0), dict(ttl_s=0.0), dict(ttl_s=-1.0)])
def test_index_rejects_bad_limits(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        PrefixIndex(**kw)  # type: ignore[arg-type]


# ---- prefill choice --------------------------------------------------------

def test_prefill_goes_to_the_worker_with_the_cache_hit() -> None:
    snap = snapshot(1024, {"p1": 40}, prefill_load("p0"), prefill_load("p1"), decode_load("d0"))
    worker, reason, costs = choose_prefill(snap, 1.0)
    assert (worker, reason) == ("p1", RouteReason.CACHE_HIT)
    assert [(c.worker_id, c.uncached_blocks, c.cost) for c in costs] == [("p1", 24, 24.0), ("p0", 64, 64.0)]


@pytest.mark.parametrize(("w", "queued", "winner", "reason"), [
    # p1 saves 40 blocks; it loses once w * queued / 16 reaches 40.
    (1.0, 624, "p1", RouteReason.CACHE_HIT),  # 24 + 39 = 63 < 64
    (1.0, 640, "p0", RouteReason.LOAD_OVER_CACHE),  # 24 + 40 = 64: equal cost, shorter queue wins
    (1.0, 656, "p0", RouteReason.LOAD_OVER_CACHE),  # 24 + 41 = 65 > 64
    (2.0, 304, "p1", RouteReason.CACHE_HIT),  # 24 + 2 * 19 = 62
    (2.0, 336, "p0", RouteReason.LOAD_OVER_CACHE),  # 24 + 2 * 21 = 66
    (0.0, 10**6, "p1", RouteReason.CACHE_HIT),  # w = 0: cache only
])
def test_queued_worker_loses_to_idle_cold_one_at_the_crossover(
    w: float, queued: int, winner: str, reason: RouteReason,
) -> None:
    snap = snapshot(1024, {"p1": 40}, prefill_load("p0"), prefill_load("p1", queued_prefill_tokens=queued))
    got, why, costs = choose_prefill(snap, w)
    assert (got, why) == (winner, reason)
    cost = {c.worker_id: c.cost for c in costs}
    assert cost == {"p0": 64.0, "p1": 24 + w * queued / BS}


def test_full_hit_still_computes_the_last_block() -> None:
    snap = snapshot(64, {"p0": 4}, prefill_load("p0"))
    assert snap.cached_blocks("p0") == 3 and snap.uncached_tokens("p0") == 16


def test_unhealthy_workers_are_never_chosen() -> None:
    snap = snapshot(
        1024, {"p0": 60, "d0": 60},
        prefill_load("p0", healthy=False), prefill_load("p1", queued_prefill_tokens=10**6),
        decode_load("d0", healthy=False), decode_load("d1", running_requests=50),
    )
    decision = route(snap, RouterConfig(max_prefill_backlog_tokens=0))  # p1's queue alone would send it to d1
    assert (decision.prefill_worker, decision.decode_worker) == ("p1", "d1")
    assert all(c.worker_id != "p0" for c in decision.costs)
    p, d, _ = choose_round_robin(snap, 0)
    assert (p, d) == ("p1", "d1")


def test_no_healthy_prefill_worker_is_a_clear_error_or_a_local_fallback() -> None:
    snap = snapshot(1024, {}, prefill_load("p0", healthy=False), decode_load("d0"))
    with pytest.raises(NoHealthyWorkerError, match="no healthy prefill worker"):
        choose_prefill(snap, 1.0)
    decision = route(snap, RouterConfig())
    assert decision.reason is RouteReason.NO_PREFILL_WORKER
    assert decision.local_prefill and decision.prefill_worker is None and decision.decode_worker == "d0"
    with pytest.raises(NoHealthyWorkerError, match="prefill"):
        route(snap, RouterConfig(fallback_local_prefill=False))
    with pytest.raises(NoHealthyWorkerError, match="prefill"):
        route(snap, RouterConfig(policy=RoutingPolicy.ROUND_ROBIN, fallback_local_prefill=False))


def test_no_healthy_decode_worker_is_a_clear_error() -> None:
    snap = snapshot(1024, {}, prefill_load("p0"), decode_load("d0", healthy=False))
    for policy in RoutingPolicy:
        with pytest.raises(NoHealthyWorkerError, match="no healthy decode worker"):
            route(snap, RouterConfig(policy=policy))


# ---- local prefill ----------------------------------------------------------

@pytest.mark.parametrize(("prompt", "d_matched", "threshold", "local"), [
    (1024, 63, 32, True),  # 16 uncached on d0 < 32
    (1024, 63, 16, False),  # 16 is not below 16
    (1024, 0, 32, False),
    (20, 0, 32, True),  # a short prompt is not worth a transfer
    (20, 0, 0, False),  # threshold 0: never local
])
def test_local_prefill_threshold(prompt: int, d_matched: int, threshold: int, local: bool) -> None:
    snap = snapshot(prompt, {"d0": d_matched}, prefill_load("p0"), decode_load("d0"))
    decision = route(snap, RouterConfig(local_prefill_threshold_tokens=threshold))
    assert decision.local_prefill is local
    if local:
        assert decision.prefill_worker is None and decision.reason is RouteReason.LOCAL_PREFILL
        assert decision.transferred_blocks == 0 and decision.costs == ()
        assert decision.cached_prompt_tokens == d_matched * BS
    else:
        assert decision.prefill_worker == "p0"
        assert decision.transferred_blocks == snap.prompt_blocks - d_matched  # d0's own prefix is not sent


def test_a_colocated_worker_that_wins_both_roles_prefills_locally() -> None:
    both = WorkerLoad("b0", WorkerRole.BOTH, free_blocks=1000, total_blocks=1000)
    snap = snapshot(1024, {"b0": 40}, both, prefill_load("p0"), decode_load("d0"))
    decision = route(snap, RouterConfig())
    assert decision.decode_worker == "b0" and decision.local_prefill and decision.prefill_worker is None
    assert decision.reason is RouteReason.CACHE_HIT


# ---- decode choice ------------------------------------------------------------

def test_decode_needs_room_for_the_prompt_plus_headroom() -> None:
    # 64 prompt blocks + 16 headroom = 80 needed; d0 holds the prefix but has 79 free.
    snap = snapshot(1024, {"d0": 60}, decode_load("d0", free_blocks=79), decode_load("d1", free_blocks=80))
    assert choose_decode(snap, headroom_blocks=16) == ("d1", DecodeReason.LEAST_LOADED)
    assert choose_decode(snap, headroom_blocks=15) == ("d0", DecodeReason.PREFIX_AFFINITY)


def test_decode_with_no_room_anywhere_takes_the_most_free_blocks() -> None:
    snap = snapshot(1024, {}, decode_load("d0", free_blocks=10), decode_load("d1", free_blocks=30))
    assert choose_decode(snap, headroom_blocks=16) == ("d1", DecodeReason.NO_ROOM)


def test_decode_prefers_the_prefix_holder_only_when_load_is_similar() -> None:
    loads = [decode_load("d0", running_requests=5), decode_load("d1", running_requests=3)]
    snap = snapshot(1024, {"d0": 40}, *loads)
    assert choose_decode(snap, load_slack=2) == ("d0", DecodeReason.PREFIX_AFFINITY)
    assert choose_decode(snap, load_slack=1) == ("d1", DecodeReason.LEAST_LOADED)
    # No prefix anywhere: the smaller batch, then the more free blocks.
    cold = snapshot(1024, {}, decode_load("d0", running_requests=3, free_blocks=900), *loads[1:])
    assert choose_decode(cold, load_slack=2) == ("d1", DecodeReason.LEAST_LOADED)
    cold = snapshot(1024, {}, decode_load("d0", running_requests=3, free_blocks=900),
                    decode_load("d1", running_requests=3, free_blocks=500))
    assert choose_decode(cold, load_slack=2) == ("d0", DecodeReason.LEAST_LOADED)


# ---- determinism, round robin, config ------------------------------------------

def test_ties_are_broken_deterministically() -> None:
    loads = [prefill_load(f"p{i}") for i in range(4)] + [decode_load(f"d{i}") for i in range(4)]
    plain = snapshot(1024, {}, *loads)
    assert route(plain, RouterConfig()).prefill_worker == "p0"  # no affinity key: by worker id
    assert route(plain, RouterConfig()).decode_worker == "d0"
    for key in (1, 2, 3, 12345):
        picks = {route(snapshot(1024, {}, *order, key=key), RouterConfig()).prefill_worker
                 for order in (loads, loads[::-1], loads[2:] + loads[:2])}
        assert len(picks) == 1  # same snapshot, whatever the order of the loads
    # Different prefixes spread over the workers (rendezvous hashing on the first block).
    spread = {route(snapshot(1024, {}, *loads, key=key), RouterConfig()).prefill_worker for key in range(64)}
    assert spread == {"p0", "p1", "p2", "p3"}


def test_round_robin_cycles_and_hands_back_its_counter() -> None:
    snap = snapshot(1024, {"p0": 60}, prefill_load("p0"), prefill_load("p1", healthy=False), prefill_load("p2"),
                    decode_load("d0"), decode_load("d1"))
    config = RouterConfig(policy=RoutingPolicy.ROUND_ROBIN, local_prefill_threshold_tokens=0)
    counter, picks = 0, []
    for _ in range(4):
        decision = route(snap, config, counter)
        counter = decision.next_rr_counter
        picks.append((decision.prefill_worker, decision.decode_worker, decision.reason))
    assert counter == 4
    assert picks == [("p0", "d0", RouteReason.ROUND_ROBIN), ("p2", "d1", RouteReason.ROUND_ROBIN),
                     ("p0", "d0", RouteReason.ROUND_ROBIN), ("p2", "d1", RouteReason.ROUND_ROBIN)]
    assert route(snap, config, 1) == route(snap, config, 1)  # pure


@pytest.mark.parametrize(("field", "value"), [
    ("policy", "cache_aware"), ("load_weight", -1.0), ("load_weight", float("nan")),
    ("local_prefill_threshold_tokens", -1), ("decode_headroom_blocks", 1.5), ("decode_load_slack", True),
])
def test_config_is_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})  # type: ignore[arg-type]


def test_snapshot_and_load_are_validated() -> None:
    with pytest.raises(ValueError, match="free_blocks"):
        WorkerLoad("w", WorkerRole.DECODE, free_blocks=5, total_blocks=4)
    with pytest.raises(ValueError, match="queued_prefill_tokens"):
        WorkerLoad("w", WorkerRole.PREFILL, queued_prefill_tokens=-1)
    with pytest.raises(TypeError, match="role"):
        WorkerLoad("w", "prefill")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate"):
        snapshot(10, {}, prefill_load("p0"), prefill_load("p0"))
    with pytest.raises(ValueError, match="prompt_tokens"):
        snapshot(0, {})


# ---- Router ---------------------------------------------------------------------

@pytest.mark.parametrize(("p_queued", "d_queued", "threshold", "local"), [
    (1024, 0, 1024, True),  # the prefill worker is a threshold behind; the decode worker is idle
    (1023, 0, 1024, False),  # under the threshold: disaggregated as usual
    (4096, 4096, 1024, False),  # the decode worker is as far behind: it would only trade places
    (4096, 3840, 1024, False),  # its queue plus this prompt (256) is not below the prefill worker's
    (4096, 3839, 1024, True),
    (10**6, 0, 0, False),  # 0: off
])
def test_a_decode_worker_prefills_when_the_prefill_worker_is_further_behind(
        p_queued: int, d_queued: int, threshold: int, local: bool) -> None:
    snap = snapshot(256, {}, prefill_load("p0", queued_prefill_tokens=p_queued),
                    decode_load("d0", queued_prefill_tokens=d_queued))
    decision = route(snap, RouterConfig(max_prefill_backlog_tokens=threshold))
    assert decision.local_prefill is local and decision.decode_worker == "d0"
    if local:
        assert decision.reason is RouteReason.PREFILL_BACKLOG and decision.prefill_worker is None
        assert decision.transferred_blocks == 0 and "p0 has" in decision.detail
    else:
        assert decision.prefill_worker == "p0" and decision.plan is Plan.HANDOFF


def test_a_backlog_is_shared_between_the_prefill_and_the_decode_worker_not_moved() -> None:
    # A burst of 256-token prompts onto 1P+1D whose prefill worker is 2048 tokens behind:
    # the router charges each prompt where it sent it, so the decode worker takes prompts
    # until its own queue is as long, then they alternate.
    router = Router(RouterConfig(max_prefill_backlog_tokens=1024), BS)
    router.update_load(prefill_load("p0", queued_prefill_tokens=2048))
    router.update_load(decode_load("d0"))
    rng = random.Random(0)
    plans = [router.route(f"r{i}", [rng.randrange(1, 30000) for _ in range(256)]).plan for i in range(12)]
    assert plans[:7] == [Plan.LOCAL] * 7  # d0's queue 0, 256, ..., 1536, each plus the prompt, < 2048
    assert plans[7:] == [Plan.HANDOFF, Plan.LOCAL] * 2 + [Plan.HANDOFF]
    assert router.stats.decisions[RouteReason.PREFILL_BACKLOG] == plans.count(Plan.LOCAL)
    p, d = router.loads["p0"].queued_prefill_tokens, router.loads["d0"].queued_prefill_tokens
    assert (p, d) == (2048 + 3 * 256, 9 * 256)  # within two prompts of each other


def make_router(**config: object) -> Router:
    router = Router(RouterConfig(**config), BS)  # type: ignore[arg-type]
    for load in (prefill_load("p0"), prefill_load("p1"), decode_load("d0")):
        router.update_load(load)
    return router


def test_router_routes_onto_the_worker_that_reported_the_prefix() -> None:
    router = make_router(local_prefill_threshold_tokens=0)
    tokens = list(range(200))
    hashes = block_hashes(tokens)
    events = [KVEvent(KVEventKind.STORED, h, hashes[i - 1] if i else ROOT_HASH) for i, h in enumerate(hashes[:10])]
    router.on_kv_events("p1", events)
    decision = router.route("r0", tokens)
    assert decision.prefill_worker == "p1" and decision.reason is RouteReason.CACHE_HIT
    assert decision.prefill_cached_blocks == 10
    assert router.stats.prompt_tokens == 200 and router.stats.cached_prompt_tokens == 160
    assert router.stats.decisions == {RouteReason.CACHE_HIT: 1}
    # Charged to p1 until its next report: a burst does not pile onto one "idle" worker.
    assert router.loads["p1"].queued_prefill_tokens == 40
    assert router.loads["d0"].running_requests == 1
    router.update_load(prefill_load("p1"))
    assert router.loads["p1"].queued_prefill_tokens == 0


def test_router_forgets_a_cache_whose_events_were_lost() -> None:
    router = make_router(local_prefill_threshold_tokens=0)
    tokens = list(range(64))
    router.on_kv_events("p0", stored(*block_hashes(tokens)))
    assert router.route("r0", tokens).prefill_worker == "p0"
    router.forget_cache("p0")
    assert router.index.num_blocks("p0") == 0 and "p0" in router.loads  # still a worker, with no known cache
    assert router.route("r1", tokens).reason is RouteReason.COLD
    with pytest.raises(ValueError, match="empty prompt"):
        router.route("r2", [])


def test_a_single_token_request_runs_on_the_prefill_worker_and_charges_no_decode_work() -> None:
    router = make_router(local_prefill_threshold_tokens=0)
    tokens = list(range(64))
    decision = router.route("r0", tokens, max_tokens=1)
    assert decision.plan is Plan.PREFILL_ONLY and decision.prefill_worker is not None
    assert decision.transferred_blocks == 0 and router.stats.transferred_blocks == 0
    assert router.loads["d0"].running_requests == 0
    assert router.loads[decision.prefill_worker].queued_prefill_tokens == 64
    assert router.route("r1", tokens, max_tokens=2).plan is Plan.HANDOFF


# ---- simulation ---------------------------------------------------------------

def shared_prefix_prompts(seed: int = 0, groups: int = 8, per_group: int = 16, prefix: int = 512,
                          question: int = 32, vocab: int = 32000) -> list[list[int]]:
    """Like SGLang's generated-shared-prefix set: random prefix per group, a random
    question per request, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prefix)]
        prompts += [shared + [rng.randrange(vocab) for _ in range(question)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def prefill_on(kv: KVCacheManager, request_id: str, tokens: list[int]) -> int:
    """What a prefill worker does with the prompt's KV blocks; returns tokens computed."""
    request = Request(request_id, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    blocks, num_cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, len(tokens) - num_cached, blocks)
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    kv.free(request)
    return len(tokens) - num_cached


def simulate(policy: RoutingPolicy, kv_blocks: int, drain_tokens: int = 300) -> int:
    """2 prefill workers with `kv_blocks` each, 1 decode worker; one arrival per
    tick, each prefill worker computes `drain_tokens` of its queue per tick.
    Returns the prompt tokens computed by prefill workers."""
    router = Router(RouterConfig(policy=policy, local_prefill_threshold_tokens=0), BS)
    kvs = {w: KVCacheManager(kv_blocks, BS, record_events=True) for w in ("p0", "p1")}
    queued = dict.fromkeys(kvs, 0)
    computed = 0
    for i, tokens in enumerate(shared_prefix_prompts()):
        for w in kvs:
            router.update_load(prefill_load(
                w, queued_prefill_tokens=queued[w], free_blocks=kv_blocks, total_blocks=kv_blocks))
        router.update_load(decode_load("d0"))
        decision = router.route(f"r{i}", tokens)
        worker = decision.prefill_worker
        assert worker is not None
        n = prefill_on(kvs[worker], f"r{i}", tokens)
        assert n == decision.computed_prompt_tokens  # events kept the router's view exact
        router.on_kv_events(worker, kvs[worker].pool.take_events())
        computed += n
        queued[worker] += n
        queued = {w: max(0, q - drain_tokens) for w, q in queued.items()}
    return computed


def test_simulation_cache_aware_computes_far_less_prefill_than_round_robin() -> None:
    # Each worker's KV holds 192 blocks: the 8 prefixes (8 x 32 blocks) fit
    # across the two workers but not in one, the case a real cluster is in.
    cache_aware = simulate(RoutingPolicy.CACHE_AWARE, kv_blocks=192)
    round_robin = simulate(RoutingPolicy.ROUND_ROBIN, kv_blocks=192)
    # Ideal: each prefix once (8 x 544) + each other request's question (120 x 32).
    assert cache_aware == 8 * 544 + 120 * 32 == 8192
    assert round_robin == 25696
    assert round_robin >= 2 * cache_aware


def test_simulation_with_unbounded_caches_round_robin_pays_each_prefix_twice() -> None:
    # With room for everything, round robin only loses the second copy of each
    # prefix: 1.5x here, so the 2x above comes from partitioning the working set.
    assert simulate(RoutingPolicy.CACHE_AWARE, kv_blocks=10_000) == 8192
    assert simulate(RoutingPolicy.ROUND_ROBIN, kv_blocks=10_000) == 8192 + 8 * 512 == 12288


def test_a_retry_is_routed_around_the_worker_it_failed_on_while_another_can_decode() -> None:
    router = Router(RouterConfig(local_prefill_threshold_tokens=1 << 20), BS)  # every prompt prefills locally
    router.update_load(decode_load("d0"))
    router.update_load(decode_load("d1", running_requests=5))  # busier: d0 wins unless avoided
    prompt = list(range(100))
    assert router.route("r", prompt).decode_worker == "d0"
    assert router.route("r", prompt, avoid="d0").decode_worker == "d1"
    assert router.route("r", prompt, avoid="d1").decode_worker == "d0"
    router.update_load(decode_load("d1", healthy=False))
    assert router.route("r", prompt, avoid="d0").decode_worker == "d0"  # the only one left
    assert router.loads["d0"].healthy  # avoided for one request, not taken out of routing
