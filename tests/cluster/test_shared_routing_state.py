"""Shared routing state (issue 47): gateway replicas polling the same workers each
see every KV event, so each holds the same prefix index, and that index is what
the worker's block pool caches (the oracle), whoever started late, fell behind
the worker's event log, or polled across a worker's restart.

Two layers: a block pool under random traffic read by routers at different paces
(fast, many steps), and real prefill worker services polled by two or three
`DisaggregatedBackend`s through `LocalActor` handles (the gateway's own poll code)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from factories import LocalActor, tiny_spec

from pdserve import SamplingParams
from pdserve.cluster.actors import PrefillService
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import RouterConfig
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.kv.block_pool import BlockPool
from pdserve.workers.kv.event_log import KVEventLog
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.tiny.builder import TinyModelSpec

BS = 16
W = "p0"


# -- a block pool read by routers at different paces ------------------------------------


class _Traffic:
    """Random pool traffic as sequences make it: allocate and cache chains (hashes from
    a small set, so some repeat and some are found again), reuse cached blocks, free
    tail first, now and then empty the cache (a role switch)."""

    def __init__(self, pool: BlockPool, seed: int) -> None:
        self.pool, self.rng, self.held = pool, random.Random(seed), list[list[int]]()

    def step(self) -> None:
        pool, rng, r = self.pool, self.rng, self.rng.random()
        if r < 0.45 and pool.num_free >= 3:
            parent = None
            blocks = pool.allocate(rng.randint(1, 3))
            for b in blocks:
                h = rng.randrange(1, 60)
                pool.cache(b, h, parent)
                parent = h
            self.held.append(blocks)
        elif r < 0.6:
            found = pool.lookup(rng.randrange(1, 60))
            if found is not None:
                pool.touch([found])
                self.held.append([found])
        elif r < 0.99 and self.held:
            pool.free(reversed(self.held.pop(rng.randrange(len(self.held)))))
        else:
            for blocks in self.held:
                pool.free(reversed(blocks))
            self.held.clear()
            pool.reset_cache()


class _Reader:
    """A gateway replica's router, reading the pool as `load(since)` does."""

    def __init__(self) -> None:
        self.router, self.snapshots = Router(RouterConfig(), BS), 0

    def poll(self, pool: BlockPool) -> None:
        batch = KVEventBatch.of(W, pool.read_events(self.router.kv_cursor(W)))
        self.snapshots += batch.snapshot
        self.router.on_kv_batch(W, batch)

    @property
    def view(self) -> frozenset[int]:
        return self.router.index.blocks(W)


@pytest.mark.parametrize("seed", range(4))
def test_routers_polling_at_any_pace_hold_what_the_pool_caches(seed: int) -> None:
    """Three readers poll one pool: every step, every 7th step, and every 150th (past
    the log's 64 events: it lives on snapshots). Each equals the pool whenever it polls;
    a fourth that starts at the end equals them at once."""
    pool = BlockPool(24, record_events=True, event_log_size=64)
    traffic, rng = _Traffic(pool, seed), random.Random(seed + 100)
    readers = {1: _Reader(), 7: _Reader(), 150: _Reader()}
    for step in range(1, 1501):
        traffic.step()
        for every, reader in readers.items():
            if step % every == 0 or rng.random() < 0.02:
                reader.poll(pool)
                assert reader.view == set(pool.cached), (step, every)
    late = _Reader()
    for reader in (*readers.values(), late):
        reader.poll(pool)
        assert reader.view == set(pool.cached)
    assert readers[1].snapshots == 1  # its first poll only: it never fell behind
    assert readers[150].snapshots > 5  # the log could not serve it: snapshots did
    assert late.snapshots == 1


def test_a_router_that_forgot_a_cache_relearns_it_from_a_snapshot() -> None:
    """A gateway forgets a worker's cache (a role switch it saw, a worker it moved to
    another pool): its next poll brings the whole cache back, not only later events."""
    pool = BlockPool(8, record_events=True)
    traffic, reader = _Traffic(pool, 5), _Reader()
    for _ in range(40):
        traffic.step()
    reader.poll(pool)
    reader.router.forget_cache(W)
    assert reader.router.kv_cursor(W) is None and reader.view == frozenset()
    traffic.step()
    reader.poll(pool)
    assert reader.snapshots == 2 and reader.view == set(pool.cached)


def test_replies_in_any_order_leave_the_index_what_the_pool_caches() -> None:
    """Polls of one worker in flight together (the poll loop and a role switch's refresh):
    poll A's reply comes after B's, and C was asked from B's cursor. Stood at A's cursor,
    the router went back, C's events began past it, and the events between were never read:
    a block the worker evicted stayed a hit for good."""
    pool, router = BlockPool(4, record_events=True), Router(RouterConfig(), BS)

    def poll() -> KVEventBatch:
        return KVEventBatch.of(W, pool.read_events(router.kv_cursor(W)))

    router.on_kv_batch(W, poll(), router.kv_forgets(W))
    forgets = router.kv_forgets(W)
    (b0,) = pool.allocate(1)
    pool.cache(b0, 111, None)  # STORED 111
    reply_a = poll()  # delivered late
    pool.free([b0])
    pool.allocate(4)  # REMOVED 111
    reply_b = poll()
    router.on_kv_batch(W, reply_b, forgets)
    assert router.index.blocks(W) == frozenset() == set(pool.cached)
    reply_c = poll()  # asked from B's cursor
    router.on_kv_batch(W, reply_a, forgets)
    router.on_kv_batch(W, reply_c, forgets)
    for _ in range(3):
        router.on_kv_batch(W, poll(), router.kv_forgets(W))
    assert router.index.blocks(W) == set(pool.cached), f"cursor {router.kv_cursor(W)}"


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_replies_converge_on_the_pool(seed: int) -> None:
    """Replies to overlapping polls applied in a random order, then one poll: the index is the pool's."""
    rng = random.Random(seed)
    pool = BlockPool(8, record_events=True)
    traffic, router = _Traffic(pool, seed), Router(RouterConfig(), BS)
    router.on_kv_batch(W, KVEventBatch.of(W, pool.read_events(None)), 0)
    for _ in range(30):
        replies = []
        for _ in range(rng.randint(1, 4)):
            traffic.step()
            replies.append(KVEventBatch.of(W, pool.read_events(router.kv_cursor(W))))
            if rng.random() < 0.5:
                router.on_kv_batch(W, replies.pop(rng.randrange(len(replies))), 0)
        rng.shuffle(replies)
        for r in replies:
            router.on_kv_batch(W, r, 0)
        router.on_kv_batch(W, KVEventBatch.of(W, pool.read_events(router.kv_cursor(W))), 0)
        assert router.index.blocks(W) == set(pool.cached)


def test_events_asked_for_before_a_cache_was_forgotten_are_dropped() -> None:
    """A poll is on its way (events from the router's cursor) when the gateway forgets the
    worker's cache: a role switch starts, then fails, and the worker keeps its cache. The
    answer's events go on from a view the router no longer holds: applied, they would set a
    cursor over the emptied view, and the blocks cached before them would never come back.
    Dropped, the next poll asks for a snapshot, and the view is the pool's again."""
    pool = BlockPool(8, record_events=True)
    traffic, reader = _Traffic(pool, 5), _Reader()
    for _ in range(40):
        traffic.step()
    reader.poll(pool)
    earlier = set(pool.cached)
    for _ in range(3):
        traffic.step()
    asked = reader.router.kv_forgets(W)
    late = KVEventBatch.of(W, pool.read_events(reader.router.kv_cursor(W)))  # the poll in flight
    assert not late.snapshot
    reader.router.forget_cache(W)  # the switch starts ...
    reader.router.on_kv_batch(W, late, asked)  # ... and the answer comes
    assert reader.router.kv_cursor(W) is None and reader.view == frozenset()
    reader.poll(pool)
    assert reader.snapshots == 2 and reader.view == set(pool.cached)
    assert earlier & set(pool.cached), "the case needs blocks cached before the late answer"


# -- real worker services, polled by gateway replicas ----------------------------------


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


_services: list[PrefillService] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _services:
        _services.pop().close()


def _worker(model_dir: Path, log_size: int | None = None) -> PrefillService:
    """A prefill worker with a small pool (24 blocks: the traffic below evicts), its
    event log cut to `log_size` events before it serves anything."""
    config = EngineConfig(model=str(model_dir), max_model_len=256, block_size=BS, max_num_batched_tokens=256)
    service = PrefillService(replace(config, num_kv_blocks=24), 1, worker_name=W)
    _services.append(service)
    if log_size is not None:
        service.engine.kv.pool.event_log = KVEventLog(log_size)  # nothing logged yet: no request has run
    return service


def _replica(service: PrefillService) -> DisaggregatedBackend:
    return DisaggregatedBackend({W: LocalActor(service)}, {}, Router(RouterConfig(), BS), poll_s=0.01)


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts over 4 shared 2-block prefixes, each with its own 1-3 blocks after."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 4000) for _ in range(2 * BS)] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(5, 4000) for _ in range(rng.randint(BS, 3 * BS))]
            for _ in range(n)]


async def _run(service: PrefillService, i: int, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    async for _ in service.async_engine.generate(f"r{i}", prompt, params):
        pass


async def _cached(service: PrefillService) -> frozenset[int]:
    """The oracle: what the worker's block pool caches now (read on its engine thread)."""
    def read(e: LLMEngine) -> frozenset[int]:
        return frozenset(e.kv.pool.cached)

    return await service.async_engine.call(read)


def _view(replica: DisaggregatedBackend) -> frozenset[int]:
    return replica.router.index.blocks(W)


def _took_snapshot(replica: DisaggregatedBackend) -> bool:
    return replica.loads[W].events.snapshot


def test_replicas_polling_one_worker_hold_the_same_index_as_its_cache(model_dir: Path) -> None:
    """Two replicas poll in turns among the requests (each poll used to drain the events:
    each replica saw some); then a third starts, and its first poll is a snapshot."""
    service = _worker(model_dir)
    a, b = _replica(service), _replica(service)
    rng = random.Random(1)

    async def main() -> None:
        for i, prompt in enumerate(_prompts(1, 24)):
            await _run(service, i, prompt)
            for replica in rng.sample([a, b], rng.randint(0, 2)):
                await replica._refresh()
        await a._refresh()
        await b._refresh()
        cached = await _cached(service)
        assert len(cached) > 5 and service.engine.kv.pool.event_log.next_seq > 24 + len(cached)  # it evicted
        assert _view(a) == _view(b) == cached
        late = _replica(service)
        await late._refresh()
        assert _took_snapshot(late) and _view(late) == cached
        for replica in (a, b, late):
            await replica.close()

    asyncio.run(main())


def test_a_replica_that_lags_past_the_log_catches_up_with_a_snapshot(model_dir: Path) -> None:
    service = _worker(model_dir, log_size=16)
    fresh, lagging = _replica(service), _replica(service)

    async def main() -> None:
        await fresh._refresh()
        await lagging._refresh()
        for i, prompt in enumerate(_prompts(2, 16)):
            await _run(service, i, prompt)
            await fresh._refresh()  # a request logs at most 10 events here: the log keeps up with it
            assert not _took_snapshot(fresh)
            if i == 3:
                await lagging._refresh()  # it learns blocks that are evicted while it lags
                assert not _took_snapshot(lagging) and _view(lagging) == _view(fresh)
        await lagging._refresh()
        assert _took_snapshot(lagging)  # its cursor is long gone from a 16-event log
        cached = await _cached(service)
        assert _view(fresh) == _view(lagging) == cached
        await _run(service, 99, _prompts(3, 1)[0])
        await lagging._refresh()  # and from there on it follows the log like the other
        await fresh._refresh()
        assert not _took_snapshot(lagging) and _view(fresh) == _view(lagging) == await _cached(service)
        await fresh.close()
        await lagging.close()

    asyncio.run(main())


def test_a_restarted_worker_is_relearned_even_where_its_seqs_passed_the_old_ones(model_dir: Path) -> None:
    """The new process logs from seq 0 again. Once it has logged more than the old one
    had, a replica's old cursor would be a valid seq of the new log: the log's id tells
    them apart, and the replica takes a snapshot instead of a wrong slice of events."""
    old = _worker(model_dir)
    replica = _replica(old)

    async def main() -> None:
        for i, prompt in enumerate(_prompts(4, 4)):
            await _run(old, i, prompt)
        await replica._refresh()
        cursor = replica.router.kv_cursor(W)
        assert cursor is not None and _view(replica) == await _cached(old)
        old.close()
        new = _worker(model_dir)
        replica.prefill[W] = LocalActor(new)  # Ray's handle reaches the restarted actor
        for i, prompt in enumerate(_prompts(5, 12)):
            await _run(new, i, prompt)
        assert new.engine.kv.pool.event_log.next_seq > cursor.seq  # the old cursor's seq is one of this log's
        await replica._refresh()
        assert replica.events.restarted == 1 and _took_snapshot(replica)
        assert _view(replica) == await _cached(new)
        await replica.close()

    asyncio.run(main())
