"""Iteration-level scheduling: which requests run this step, and how many tokens each.

Policy (vLLM v1 style, one token budget for prefill and decode alike):
  1. Running requests first, in admission order: each gets its remaining tokens
     (1 when decoding, a chunk of the prompt while prefilling), up to the budget.
     If the pool cannot hold them, the most recently admitted running request is
     preempted (blocks freed, recomputed later), never an earlier one.
  2. Then waiting requests, first come first served, while budget, the sequence
     cap and blocks allow; each starts from its longest cached prefix.
A request that ends keeps its blocks only if it holds its KV for a handoff
(`hold_kv`, a prefill worker): it stays in `requests`, finished, until `release`.
Nothing here touches tensors.

This is the one place a request's state moves inside a worker: each queue change
moves its lifecycle (`Request.life`, workers/lifecycle.py) with it, so the state a
worker reports and the queue the request is in cannot disagree.

    add                                      QUEUED (a decode worker's ROUTED -> QUEUED)
    scheduled from the waiting queue         QUEUED -> PREFILLING (its known tokens to compute)
    its first token here                     PREFILLING -> DECODING
    preempted                                PREFILLING | DECODING -> QUEUED
    reserve_remote / complete_remote         ROUTED -> TRANSFERRING -> DECODING (decode side)
    prefill_locally                          TRANSFERRING -> QUEUED (the KV failed: recompute)
    finish, holding its KV                   PREFILLING -> TRANSFERRING (prefill side, until `release`)
    finish otherwise                         its worker ends it once the output has left; a
                                             request the engine owns (offline) ends here
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.lifecycle import Exit, RequestState
from pdserve.workers.request import FinishReason, Request

_S = RequestState


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # new tokens computed this step, starting at request.num_computed_tokens
    # Of those, drafted tokens to verify (the last `num_spec`; request.spec_token_ids[:num_spec]).
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so its last logits give a token."""
        return self.request.num_computed_tokens + self.num_tokens - self.num_spec == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.awaiting_kv: dict[str, Request] = {}  # blocks reserved, KV in flight from a prefill worker
        self.requests: dict[str, Request] = {}  # every request here: live, or finished and holding its KV
        self.num_cached_prompt_tokens = 0  # served from the prefix cache at first admission
        # Prompt tokens looked up in the prefix cache, counted where the hits are (at first admission):
        # counted when added, a request aborted or timed out while it waited was a query with no
        # lookup, and the hit rate read low under load.
        self.num_queried_prompt_tokens = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if request.life.state is _S.ROUTED:  # a decode worker that could not reserve: it prefills here
            request.life.move(_S.QUEUED)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.awaiting_kv)

    def reserve_remote(self, req: Request) -> tuple[list[int], int] | None:
        """Decode side of a handoff: reserve blocks for the whole prompt (and its first
        token's slot) before its KV arrives, reusing this worker's prefix cache. Returns
        (the prompt's block ids, tokens already cached here), or None (nothing changed)
        if the pool is short."""
        req.life.check_move(_S.TRANSFERRING)  # before any block is taken: a refused move takes none
        # FCFS: a request queued here to be admitted (it could not reserve, its KV failed, it was
        # preempted) came first. A reservation would take the blocks it waits for and, landed, go
        # ahead of it in the queue: under a steady stream of handoffs it would never run. While
        # one waits, a newcomer is refused and queues behind it (it prefills here).
        if any(r.life.state is _S.QUEUED and r.schedulable for r in self.waiting):
            return None
        cached_blocks, num_cached = self.kv.find_cached_prefix(req)
        # The prompt and the slot of the prefill worker's first token, which its first step here
        # computes: landed, it waits holding its blocks, and were that slot in a block it does not
        # hold, requests that landed on a full pool (prompts ending on a block boundary) would
        # each wait for a block another holds, nothing running to give one back: for ever.
        if not self.kv.allocate_slots(req, req.num_tokens + 1 - num_cached, cached_blocks):
            return None
        req.num_cached_tokens = num_cached
        self.num_cached_prompt_tokens += num_cached
        self.num_queried_prompt_tokens += req.num_prompt_tokens
        req.life.move(_S.TRANSFERRING)
        self.requests[req.request_id] = req
        self.awaiting_kv[req.request_id] = req
        prompt_blocks = -(-req.num_tokens // self.kv.block_size)  # what its KV lands in
        return self.kv.blocks_of(req.request_id)[:prompt_blocks], num_cached

    def complete_remote(self, req: Request) -> None:
        """The prompt's KV has landed in the reserved blocks: the request joins the
        queue ahead of new work (it already holds its blocks) to decode from the
        prefill worker's first token (the caller appends it)."""
        del self.awaiting_kv[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed_blocks(req)
        req.life.move(_S.DECODING)
        self.waiting.appendleft(req)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute here, the router's measure of queued prefill work."""
        # A waiting request will start from its cached prefix, so only the rest is
        # work: counting it all would make a worker that holds a hot prefix look
        # busy and push its requests elsewhere, cold. (A request scoring its
        # prompt, prompt_logprobs, skips the cache: all of it is work.)
        queued = sum(r.num_prompt_tokens - min(r.num_computed_tokens, r.num_prompt_tokens) for r in self.running)
        for r in self.waiting:
            if r.num_computed_tokens < r.num_prompt_tokens:
                cached = 0 if r.prompt_logprobs is not None else self.kv.find_cached_prefix(r)[1]
                # A preempted or resumed request's cache may reach past its prompt (its outputs
                # are cached too): none of its prompt is left, not less than none.
                queued += max(0, r.num_prompt_tokens - max(r.num_computed_tokens, cached))
        return queued

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def prefill_locally(self, req: Request) -> None:
        """A remote prefill failed: free the reserved blocks (their content is not
        trusted) and queue the request to prefill here, ahead of new work."""
        del self.awaiting_kv[req.request_id]
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.life.move(_S.QUEUED)
        self.waiting.appendleft(req)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and req.num_output_tokens + req.num_pending >= req.max_tokens:
                i += 1  # the token in flight is its last (async scheduling): no row for what follows
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            # A decoding request with drafts verifies them in the same pass.
            num_spec = min(len(req.spec_token_ids), budget - 1) if remaining == 1 else 0
            n = min(remaining + num_spec, budget)
            if num_spec and not self.kv.allocate_slots(req, n):
                num_spec, n = 0, min(remaining, budget)  # no room for drafts: never preempt for them
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, num_spec))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: everything after it is too
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            # In order, passing over requests whose grammar is still compiling, or (preempted) whose last
            # token is still in flight: they wait, the rest go on. One whose KV came from a prefill worker
            # goes first: it holds its blocks (its first step takes no new one), and a request ahead of
            # it that needs more blocks than are free beside them would otherwise wait on them for ever:
            # one that does not fit, or one whose chunk fits but whose prompt never can, which took the
            # whole budget, preempted itself and came back to the head of the queue, step after step.
            first, holding = self._next_to_admit()
            admitted = self._admit(holding, budget) or (self._admit(first, budget) if first != holding else None)
            if admitted is None:
                break
            at, n, num_cached = admitted
            req = self.waiting[at]
            del self.waiting[at]
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                # Prompt tokens served from the cache: a resumed request's hit may reach into the
                # output its client already has, which is no prompt token.
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
                self.num_cached_prompt_tokens += req.num_cached_tokens
                self.num_queried_prompt_tokens += req.num_prompt_tokens
            if req.life.state is _S.QUEUED:  # not one whose KV came from a prefill worker (DECODING)
                req.life.move(_S.PREFILLING)
            if req.queue_time_s is None:
                req.queue_time_s = time.monotonic() - req.arrival_time
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _next_to_admit(self) -> tuple[int | None, int | None]:
        """(The first waiting request that may run, the first that may and holds blocks). A
        request holds blocks while it waits only if it went back to the head of the queue
        (its KV landed; preempted, it kept some), ahead of every request added since: the scan
        for one stops at the first request never admitted (`num_cached_tokens` still -1), so a
        long queue costs nothing here (scanning it all was quadratic in its length a step)."""
        first = None
        for i, r in enumerate(self.waiting):
            if r.num_cached_tokens < 0 and first is not None:
                return first, None  # the rest were never admitted: none holds a block
            if not r.schedulable or r.num_pending:
                continue
            if first is None:
                first = i
            if self.kv.blocks_of(r.request_id):
                return first, i
        return first, None

    def _admit(self, at: int | None, budget: int) -> tuple[int, int, int] | None:
        """Slots for the waiting request at `at`: (at, tokens scheduled, tokens cached), or None."""
        if at is None:
            return None
        req = self.waiting[at]
        cached_blocks, num_cached = self._cached(req)
        n = min(req.num_tokens - num_cached, budget)
        return (at, n, num_cached) if self.kv.allocate_slots(req, n, cached_blocks) else None

    def _cached(self, req: Request) -> tuple[list[int], int]:
        """What a waiting request starts from: (cached blocks to take, tokens they cover)."""
        if self.kv.blocks_of(req.request_id):  # KV arrived from a prefill worker
            return [], req.num_computed_tokens
        if req.prompt_logprobs is not None:  # every prompt position's logits are needed
            return [], 0
        return self.kv.find_cached_prefix(req)

    def _preempt(self, req: Request) -> None:
        # Its blocks that others hold too stay its own (`free_preempted`): it resumes after them.
        req.num_computed_tokens = self.kv.free_preempted(req)
        req.spec_token_ids, req.spec_draft_probs = [], None
        req.life.move(_S.QUEUED)
        self.waiting.appendleft(req)

    def advance(self, scheduled: ScheduledRequest, num_accepted: int = 0) -> None:
        """Record that a scheduled chunk was computed; cache its full blocks.
        Of its drafted tokens only the `num_accepted` the target kept count: the
        KV written for the others is rolled back by not counting it (the next
        step overwrites those slots)."""
        req = scheduled.request
        req.num_computed_tokens += scheduled.num_tokens - scheduled.num_spec + num_accepted
        self.kv.cache_computed_blocks(req)

    def took_token(self, req: Request, reason: FinishReason | None) -> None:
        """Tokens were appended to `req` (sampled, verified, or a prefill worker's first):
        it decodes on, or finishes with `reason`."""
        if req.life.state is _S.PREFILLING and not req.hold_kv:
            req.life.move(_S.DECODING)
        if reason is not None:
            self.finish(req, reason)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request in any state: its blocks go back to the pool at once,
        unless it holds its KV for a handoff (`hold_kv`): then until `release`.
        Its worker ends its lifecycle once the output has left (or already did,
        when this is that exit's abort); one the engine owns ends here."""
        if req.finished:
            return
        if req.request_id in self.awaiting_kv:
            del self.awaiting_kv[req.request_id]
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = reason
        if req.hold_kv and reason is not FinishReason.ABORT:
            if req.life.state is _S.PREFILLING:
                req.life.move(_S.TRANSFERRING)  # its KV is handed over from its held blocks
            return
        if req.ends_in_engine:
            req.life.end(Exit.ABORTED if reason is FinishReason.ABORT else Exit.FINISHED)
        if not req.hold_kv:
            self.release(req.request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request that held them (its KV is sent, or
        the handoff was abandoned). Unknown or live requests are left alone."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            self.kv.free(req)
            del self.requests[request_id]
            if req.ends_in_engine:
                req.life.end(Exit.ABORTED if req.finish_reason is FinishReason.ABORT else Exit.FINISHED)
