"""Which KV blocks each request holds: prefix-cache lookup, slot allocation,
caching of newly computed full blocks, and freeing."""

from __future__ import annotations

from collections import Counter

from pdserve.workers.kv.block_pool import BlockPool
from pdserve.workers.kv.hashing import extend_block_hashes, root_hash
from pdserve.workers.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, record_events)
        self.req_blocks: dict[str, list[int]] = {}
        # Blocks of each request already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that starts the request's tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking
        `cached_blocks` from the prefix cache). False, changing nothing, if the pool is short."""
        cached_blocks = cached_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(cached_blocks)
        # Cached blocks nobody references still count as free: taking them shrinks the pool.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_free - revived:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            held = held + cached_blocks
            self._num_cached_blocks[request.request_id] = len(held)
        if needed > 0:
            held = held + self.pool.allocate(needed)
        self.req_blocks[request.request_id] = held
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        self._update_hashes(request)
        blocks = self.req_blocks[request.request_id]
        for i in range(done, num_full):
            parent = request.block_hashes[i - 1] if i else root_hash(request.params.cache_salt)
            self.pool.cache(blocks[i], request.block_hashes[i], parent)
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def free_preempted(self, request: Request) -> int:
        """Free a preempted request's blocks but a leading run that something other than a
        request pins too (a prefill worker's KV send pins the blocks it reads until it is over):
        freeing those frees no memory, and a request that came back without them computed its
        prompt into new blocks beside its own pinned ones, which on a small pool never fit (it
        preempted itself for ever). The tokens the kept blocks cover (full, computed; one token
        always left to compute, as `find_cached_prefix` leaves it) are returned: the request
        resumes there.

        Blocks shared only with other requests (a prefix-cache hit) are freed: the cache finds
        them again. Kept, they were pinned by requests that do not run: two preempted requests
        sharing a prompt each kept it, two such pairs held most of a small pool, and the request
        at the head, which fits the pool alone, never fit beside them: no request finished."""
        blocks = self.req_blocks.get(request.request_id, [])
        limit = min(len(blocks), request.num_computed_tokens // self.block_size,
                    (request.num_tokens - 1) // self.block_size)
        keep = 0
        if limit and self.pool.ref_counts[blocks[0]] > 1:
            mine = set(blocks[:limit])
            held = Counter(b for bs in self.req_blocks.values() for b in bs if b in mine)  # by requests
            while keep < limit and self.pool.ref_counts[blocks[keep]] > held[blocks[keep]]:
                keep += 1
        if not keep:
            self.free(request)
            return 0
        self.pool.free(reversed(blocks[keep:]))
        self.req_blocks[request.request_id] = blocks[:keep]
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = min(self._num_cached_blocks[request.request_id], keep)
        return keep * self.block_size

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.params.cache_salt)
