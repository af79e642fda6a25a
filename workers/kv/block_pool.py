"""The pool of KV blocks: reference counts, the prefix cache, eviction.

A block is in one of three places:
  * in use (ref count > 0), owned by one or more sequences;
  * free and empty-of-value (never held a full block, or a partial one);
  * free but cached: ref count 0, still holding a full block reusable by hash.
Allocation takes empty blocks first, then evicts cached ones least recently
used first, so the cache keeps as much as the pool allows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from pdserve.workers.kv.events import KVEvent, KVEventKind


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        # Only recorded when someone drains them (a router), else they would pile up.
        self.record_events = record_events
        self.events: list[KVEvent] = []

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
        if self.record_events:
            self.events.append(KVEvent(KVEventKind.STORED, block_hash, parent_hash))

    def reset_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. after weights change)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._empty.append(block)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
            if self.record_events:
                self.events.append(KVEvent(KVEventKind.REMOVED, block_hash))
