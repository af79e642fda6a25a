"""A worker's KV event log: numbered, bounded, read from a cursor without being consumed,
and a snapshot of the pool where a cursor cannot be served."""

from __future__ import annotations

import pytest

from pdserve.workers.kv.block_pool import BlockPool
from pdserve.workers.kv.event_log import EventCursor, KVEventLog
from pdserve.workers.kv.events import KVEvent, KVEventKind


def stored(h: int, parent: int | None = None) -> KVEvent:
    return KVEvent(KVEventKind.STORED, h, parent)


def removed(h: int) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, h)


def test_reading_consumes_nothing_and_numbers_every_event() -> None:
    log = KVEventLog(capacity=8)
    for h in range(3):
        log.append(stored(h))
    start = EventCursor(log.log_id, 0)
    first, again = log.since(start), log.since(start)
    assert first == again and first is not None
    assert (first.first_seq, first.next_seq, first.snapshot) == (0, 3, False)
    assert first.events == (stored(0), stored(1), stored(2))
    tail = log.since(EventCursor(log.log_id, 2))
    assert tail is not None and tail.events == (stored(2),)
    now = log.since(EventCursor(log.log_id, 3))
    assert now is not None and now.events == () and now.next_seq == 3


def test_a_cursor_the_log_cannot_serve_gets_none() -> None:
    log = KVEventLog(capacity=4)
    for h in range(10):
        log.append(stored(h))
    assert (log.first_seq, log.next_seq) == (6, 10)
    assert log.since(None) is None  # a new reader
    assert log.since(EventCursor(log.log_id, 5)) is None  # fell behind the bound
    assert log.since(EventCursor(log.log_id, 11)) is None  # ahead of it: not this log's numbering
    assert log.since(EventCursor(KVEventLog().log_id, 8)) is None  # another log (a restarted worker)
    held = log.since(EventCursor(log.log_id, 6))
    assert held is not None and held.events == tuple(stored(h) for h in range(6, 10))


def test_bad_sizes_and_cursors_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=0)
    with pytest.raises(ValueError, match="EventCursor"):
        EventCursor("x", -1)


def test_snapshot_lists_what_the_pool_caches_in_eviction_order() -> None:
    """Unreferenced blocks least recently used first, then the referenced ones,
    each with the parent its STORED event carried."""
    pool = BlockPool(4, record_events=True)
    a, b, c = pool.allocate(3)
    pool.cache(a, 10, None)
    pool.cache(b, 11, 10)
    pool.cache(c, 12, 11)
    pool.free([c, a])  # c is evicted first, then a; b stays referenced
    snap = pool.read_events(None)
    assert snap.snapshot and snap.first_seq == snap.next_seq == 3
    assert snap.events == (stored(12, 11), stored(10), stored(11, 10))
    assert {e.block_hash for e in snap.events} == set(pool.cached)


def test_pool_serves_a_cursor_then_a_snapshot_once_it_fell_behind() -> None:
    pool = BlockPool(4, record_events=True, event_log_size=3)
    [a] = pool.allocate(1)
    pool.cache(a, 7, None)  # seq 0
    first = pool.read_events(None)
    cursor = EventCursor(first.log_id, first.next_seq)
    pool.free([a])
    pool.reset_cache()  # seq 1: 7 removed
    held = pool.read_events(cursor)
    assert not held.snapshot and held.events == (removed(7),) and held.next_seq == 2
    b, c = pool.allocate(2)
    pool.cache(b, 20, None)  # seq 2
    pool.cache(c, 21, 20)  # seq 3
    pool.free([c])
    pool.reset_cache()  # seq 4: 21 removed; the log keeps 2..4, seq 1 is gone
    behind = pool.read_events(cursor)
    assert behind.snapshot and behind.next_seq == 5 and behind.events == (stored(20),)


def test_a_pool_that_records_nothing_always_answers_a_snapshot() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.cache(a, 5, None)
    snap = pool.read_events(EventCursor("", 0))
    assert snap.snapshot and snap.log_id == "" and snap.events == (stored(5),)


def test_take_events_gives_what_came_since_its_last_call() -> None:
    pool = BlockPool(8, record_events=True, event_log_size=4)
    blocks = pool.allocate(6)
    pool.cache(blocks[0], 1, None)
    assert pool.take_events() == [stored(1)]
    for i, b in enumerate(blocks[1:], start=2):
        pool.cache(b, i, None)
    assert pool.take_events() == [stored(h) for h in (3, 4, 5, 6)]  # the log's 4: the oldest are gone
    assert pool.take_events() == []
