"""A worker's KV block pool as the simulator keeps it: counts and hashes, no tensors.

It follows workers/kv/block_pool.py: a block is held by live sequences (ref
counted when it is a cached prompt block), or free; a free block that holds a
full computed block stays cached (reusable by hash) until an allocation needs
it, least recently used first. Free = empty + evictable, as the router's
`free_blocks` counts it.

Only prompt blocks are hashed: the bench never sends one request's output as
another's prompt, so output blocks could never be hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class SeqBlocks:
    """The blocks one sequence holds: cached prompt blocks by hash, the rest counted."""

    hashed: list[int] = field(default_factory=list)
    private: int = 0

    @property
    def count(self) -> int:
        return len(self.hashed) + self.private


class KVPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.refs: dict[int, int] = {}  # cached blocks held by live sequences -> holders
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, held by none: evictable, oldest first
        self.private = 0  # held blocks not in the cache (partial, output, duplicate content)

    @property
    def free(self) -> int:
        """Blocks an allocation may take (empty + evictable)."""
        return self.num_blocks - self.private - len(self.refs)

    def match(self, hashes: tuple[int, ...], limit: int) -> int:
        """Leading blocks of `hashes` (at most `limit`) this pool caches."""
        if not self.enable_caching:
            return 0
        n = 0
        for h in hashes[:limit]:
            if h not in self.refs and h not in self.lru:
                break
            n += 1
        return n

    def can_take(self, hashes: tuple[int, ...], num_new: int) -> bool:
        """Whether taking the cached `hashes` and `num_new` fresh blocks fits."""
        revived = sum(1 for h in hashes if h in self.lru)
        return num_new <= self.free - revived

    def take(self, seq: SeqBlocks, hashes: tuple[int, ...], num_new: int) -> None:
        """Give `seq` the cached `hashes` (found by `match`) and `num_new` fresh blocks.
        The caller checked `can_take`."""
        for h in hashes:
            if h in self.lru:
                del self.lru[h]
                self.refs[h] = 1
            else:
                self.refs[h] += 1
        seq.hashed.extend(hashes)
        self.allocate(seq, num_new)

    def allocate(self, seq: SeqBlocks, n: int) -> None:
        if n <= 0:
            return
        if n > self.free:
            raise RuntimeError(f"KV pool: {n} blocks asked, {self.free} free")
        # empty blocks first, then evict cached ones, least recently used first
        empty = self.free - len(self.lru)
        for _ in range(max(0, n - empty)):
            self.lru.popitem(last=False)
        self.private += n
        seq.private += n

    def cache(self, seq: SeqBlocks, hashes: tuple[int, ...]) -> None:
        """`seq`'s private blocks that now hold these full computed prompt blocks join the cache
        (one whose content is cached already stays private, as block_pool.cache keeps the first)."""
        if not self.enable_caching:
            return
        for h in hashes:
            if seq.private <= 0:
                return
            if h in self.refs or h in self.lru:
                continue
            seq.private -= 1
            self.private -= 1
            self.refs[h] = 1
            seq.hashed.append(h)

    def release(self, seq: SeqBlocks) -> None:
        """Free everything `seq` holds; its cached blocks become evictable, its tail first
        (the tail is the least shared, so it should go first)."""
        for h in reversed(seq.hashed):
            n = self.refs[h] - 1
            if n:
                self.refs[h] = n
            else:
                del self.refs[h]
                self.lru[h] = None
        self.private -= seq.private
        seq.hashed, seq.private = [], 0
