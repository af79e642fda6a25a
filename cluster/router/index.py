"""The router's view of which KV blocks each worker caches, fed by KV events.

Block hashes are chained (`workers/kv/hashing.py`): the hash of block i names
the whole prefix up to and including it. So "worker W holds the first n blocks
of this prompt" needs no tree: a set of hashes per worker, plus a reverse map
hash -> workers, answers it by walking the prompt's hashes until W misses one.

Staleness. The view is only as fresh as the events that reach it:
  * a lost or late REMOVED leaves a *stale hit*: the router sends a request to
    a worker for a prefix it no longer has. The worker recomputes it (it does
    its own lookup), so the cost is extra prefill time, never a wrong answer.
  * a lost STORED, or an entry dropped here by the cap or the TTL while the
    worker still holds it, is a *missed hit*: the prefix is recomputed
    elsewhere. Also only a cost.
Events are not lost in transit: a router reads each worker's numbered event log
from its own cursor, and takes a snapshot where the log no longer holds it
(`workers/kv/event_log.py`), so every gateway replica ends with the same view.
The per-worker cap bounds memory whatever events are lost: past it the least
recently stored/used entry goes (the worker's own pool evicts LRU too, so this
tends to drop what the worker dropped). The optional TTL bounds how long a
lost REMOVED can mislead, at the price of forgetting prefixes the worker still
holds once they have gone unused for `ttl_s`: a worker reports STORED only
once per block, so only `touch` (called by the router when it routes onto a
cached prefix) keeps a hot prefix alive. Leave it off (None) when events are
delivered reliably; set it to a few eviction lifetimes when they are not.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from pdserve.workers.kv.events import KVEvent, KVEventKind


class PrefixIndex:
    """Per-worker sets of cached block hashes with a reverse map; not thread-safe.

    The owner (the `Router`) calls `apply_events` with each worker's events in
    the order the worker emitted them, `replace_worker` with a snapshot of its
    cache, and `remove_worker` when what it caches is unknown. `match` never blocks.
    """

    def __init__(
        self, max_blocks_per_worker: int = 1 << 18, ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_worker <= 0:
            raise ValueError(f"max_blocks_per_worker: must be > 0, got {max_blocks_per_worker}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0 or None, got {ttl_s}")
        self.max_blocks_per_worker = max_blocks_per_worker
        self.ttl_s = ttl_s
        self._clock = clock
        # worker -> {block hash: last stored/touched time}, least recent first.
        self._blocks: dict[str, OrderedDict[int, float]] = {}
        self._holders: dict[int, set[str]] = {}  # block hash -> workers holding it

    @property
    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Entries held for one worker, or for all of them."""
        if worker_id is not None:
            return len(self._blocks.get(worker_id, ()))
        return sum(len(b) for b in self._blocks.values())

    def holds(self, worker_id: str, block_hash: int) -> bool:
        return self._fresh(worker_id, block_hash, self._clock())

    def apply_events(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """STORED adds (or refreshes) a block on the worker, REMOVED drops it.

        REMOVED for an unknown block is ignored: it may have been capped or
        expired here already.
        """
        now = self._clock()
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for event in events:
            if event.kind is KVEventKind.STORED:
                self._store(worker_id, blocks, event.block_hash, now)
            elif event.kind is KVEventKind.REMOVED:
                if blocks.pop(event.block_hash, None) is not None:
                    self._unhold(worker_id, event.block_hash)
            else:
                raise ValueError(f"unknown KV event kind {event.kind!r}")
        self._expire_worker(worker_id, now)

    def touch(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """Mark blocks the worker holds as just used (LRU order and TTL), as the
        worker's own pool does when a request reuses them."""
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            return
        now = self._clock()
        for h in block_hashes:
            if h in blocks:
                blocks[h] = now
                blocks.move_to_end(h)

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything the worker held (it left, or restarted empty)."""
        for h in self._blocks.pop(worker_id, ()):
            self._unhold(worker_id, h)

    def replace_worker(self, worker_id: str, snapshot: Iterable[KVEvent]) -> None:
        """What the worker holds is `snapshot` (STORED events, least recently used
        first) and nothing else: a snapshot of its cache, read from its event log."""
        self.remove_worker(worker_id)
        self.apply_events(worker_id, snapshot)

    def blocks(self, worker_id: str) -> frozenset[int]:
        """The block hashes held for the worker (past the TTL too, until expired)."""
        return frozenset(self._blocks.get(worker_id, ()))

    def expire(self) -> None:
        """Drop entries past the TTL on every worker (`match` already ignores them;
        this only gives the memory back)."""
        now = self._clock()
        for worker_id in list(self._blocks):
            self._expire_worker(worker_id, now)

    def match(self, prompt_block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading prompt blocks each worker holds; workers with none are left out.

        Walks the prompt's hashes keeping the set of workers that held every
        block so far, so it costs O(prompt blocks x matching workers), however
        much is cached.
        """
        now = self._clock()
        matched: dict[str, int] = {}
        alive: set[str] | None = None  # None: before the first block
        for i, h in enumerate(prompt_block_hashes):
            holders = self._holders.get(h, set())
            still = set(holders) if alive is None else alive & holders
            if self.ttl_s is not None:
                still = {w for w in still if self._fresh(w, h, now)}
            if alive is not None:
                for w in alive - still:
                    matched[w] = i
            alive = still
            if not alive:
                return matched
        for w in alive or ():
            matched[w] = len(prompt_block_hashes)
        return matched

    def _store(self, worker_id: str, blocks: OrderedDict[int, float], h: int, now: float) -> None:
        if h in blocks:
            blocks.move_to_end(h)
        else:
            self._holders.setdefault(h, set()).add(worker_id)
        blocks[h] = now
        while len(blocks) > self.max_blocks_per_worker:
            old, _ = blocks.popitem(last=False)
            self._unhold(worker_id, old)

    def _unhold(self, worker_id: str, h: int) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]

    def _fresh(self, worker_id: str, h: int, now: float) -> bool:
        blocks = self._blocks.get(worker_id)
        stamp = blocks.get(h) if blocks is not None else None
        return stamp is not None and (self.ttl_s is None or now - stamp <= self.ttl_s)

    def _expire_worker(self, worker_id: str, now: float) -> None:
        if self.ttl_s is None:
            return
        blocks = self._blocks[worker_id]
        while blocks:
            h, stamp = next(iter(blocks.items()))
            if now - stamp <= self.ttl_s:
                break
            del blocks[h]
            self._unhold(worker_id, h)
