"""The pool of KV blocks: reference counts, the prefix cache, eviction.

A block is in one of three places:
  * in use (ref count > 0), owned by one or more sequences;
  * free and empty-of-value (never held a full block, or a partial one);
  * free but cached: ref count 0, still holding a full block reusable by hash.
Allocation takes empty blocks first, then evicts cached ones least recently
used first, so the cache keeps as much as the pool allows.

What enters and leaves the cache is numbered in a bounded event log
(`workers/kv/event_log.py`, when recording): routers read it from a cursor
(`read_events`), or take a snapshot of what is cached when they cannot.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from pdserve.workers.kv.event_log import DEFAULT_CAPACITY, EventCursor, EventSlice, KVEventLog
from pdserve.workers.kv.events import KVEvent, KVEventKind


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False,
                 event_log_size: int = DEFAULT_CAPACITY) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # A cached block's STORED event, kept for snapshots: building 100k events at once
        # would hold the engine thread ~0.3 s; referencing them costs a list copy.
        self._stored_event: dict[int, KVEvent] = {}  # block id -> it
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        # Recorded for a router (the log is bounded: nobody need drain it).
        self.event_log = KVEventLog(event_log_size) if record_events else None
        self._taken = 0  # where `take_events` stands in the log

    @property
    def num_free(self) -> int:
        """Blocks that an allocation may take (empty + evictable cached)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} KV blocks: {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks found by `lookup` (revives evictable ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block. Pass a sequence's blocks tail first: the
        tail is the least shared, so it should be evicted first."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._empty.append(block)
                else:
                    self._evictable[block] = None

    def cache(self, block: int, block_hash: int, parent_hash: int | None) -> None:
        """Register a block whose content is now a full, computed block."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds the same content; keep that one
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        event = self._stored_event[block] = KVEvent(KVEventKind.STORED, block_hash, parent_hash)
        if self.event_log is not None:
            self.event_log.append(event)

    def reset_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._empty.append(block)

    def cached_blocks(self) -> tuple[KVEvent, ...]:
        """Every cached block as the STORED event that announced it: unreferenced ones
        first, least recently used first (the order this pool evicts them), then the
        referenced ones. A router that applies them in order keeps the same LRU order."""
        stored, refs = self._stored_event, self.ref_counts
        return (*[stored[b] for b in self._evictable], *[stored[b] for b in self.cached.values() if refs[b] > 0])

    def read_events(self, since: EventCursor | None) -> EventSlice:
        """The events after `since` if the log holds them all, else a snapshot
        (`cached_blocks`) at the log's current seq. A pool that records no events
        always answers a snapshot (log id "", seq 0)."""
        if self.event_log is None:
            return EventSlice("", 0, 0, self.cached_blocks(), snapshot=True)
        return self.event_log.since(since) or self.event_log.snapshot(self.cached_blocks())

    def take_events(self) -> list[KVEvent]:
        """The events since the previous call, for a reader in this process (tests, the
        profiler). Past the log's size the oldest are gone; a reader that must see every
        change reads with a cursor (`read_events`), which then gives it a snapshot."""
        if self.event_log is None:
            return []
        log = self.event_log
        got = log.since(EventCursor(log.log_id, max(self._taken, log.first_seq)))
        self._taken = log.next_seq
        return list(got.events) if got is not None else []

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
            del self._stored_event[block]
            if self.event_log is not None:
                self.event_log.append(KVEvent(KVEventKind.REMOVED, block_hash))
