"""One simulated worker: workers/scheduler.py's policy over a `KVPool`, timed by a `CostModel`.

Each step, as the real scheduler does it (vLLM v1 style, one token budget):
  1. running sequences in admission order: a decoding one takes its row's tokens
     (1, or 1 + drafts with speculative decoding), a prefilling one the next chunk
     of its prompt, up to the budget; when the pool is short the most recently
     admitted one is preempted (blocks freed, recomputed later);
  2. then waiting ones, first come first served, while budget, `max_num_seqs` and
     blocks allow, each from its longest cached prefix.
The step lasts `CostModel.step_s` of its chunks and rows, plus, on a CPU profile's host
(`CostModel.host`), the CPU the cluster charges the worker for work outside the engines
(`Hooks.stream_cpu`: streaming this step's tokens; `debt`: the worker's share of KV
handoffs' threads, paid at the start of its next step).

Speed: when a step has decode rows only and nothing waiting can start, the
next steps are the same batch with contexts one step longer each, so the worker
plans them as one *segment* of k steps (step j lasts s0 + j*d, a closed-form
sum) ending at the first sequence to finish or run out of blocks. Anything that
lands on the worker meanwhile (`poke`) cuts the segment at the next step
boundary, where the real engine would have seen it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.cluster.planner.costs import CostModel
from pdserve.cluster.planner.sim_kv import KVPool
from pdserve.cluster.planner.sim_seq import EngineSettings, Seq, SeqKind, Track
from pdserve.cluster.planner.sim_workload import SimRequest
from pdserve.cluster.router.policy import WorkerRole

__all__ = ["EngineSettings", "Hooks", "Seq", "SeqKind", "SimWorker", "Track"]  # the settings and state re-exported

_MAX_SEGMENT_STEPS = 1 << 20  # a bound on one segment; finishing sequences end it far sooner


@dataclass
class _Rows:
    """A decode batch as arrays, for planning a segment: each row's context, blocks held and
    output tokens left."""

    ctx: np.ndarray
    held: np.ndarray
    left: np.ndarray
    block_size: int
    tps: float

    @classmethod
    def of(cls, rows: list[Seq], e: EngineSettings) -> _Rows:
        return cls(np.array([s.context for s in rows]), np.array([s.blocks.count for s in rows]),
                   np.array([s.req.output_len - s.generated for s in rows]), e.block_size, e.tokens_per_step)

    def growth(self, steps: int) -> list[int]:
        """Fresh blocks each row needs to hold its context after `steps` more steps."""
        need = np.ceil((self.ctx + steps * self.tps) / self.block_size - 1e-9) - self.held
        return np.maximum(need, 0).astype(int).tolist()  # type: ignore[no-any-return]

    def steps(self, free: int) -> int:
        """Steps the batch can run unchanged: until the first row finishes, and while `free`
        blocks hold its growing contexts (1 always fits: the schedule checked it)."""
        k = int(min(_MAX_SEGMENT_STEPS, max(1, np.ceil(self.left / self.tps - 1e-9).min())))
        if sum(self.growth(k)) <= free:
            return k
        lo, hi = 1, k
        while hi - lo > 1:  # bounded: log2(k) halvings
            mid = (lo + hi) // 2
            if sum(self.growth(mid)) <= free:
                lo = mid
            else:
                hi = mid
        return lo


@dataclass
class _Step:
    """The step (or decode-only segment of k steps) in flight: step j lasts s0 + j*d."""

    start: float
    rows: list[Seq]
    chunks: list[tuple[Seq, int]]
    k: int
    s0: float
    d: float
    growth: list[int]  # blocks each row was given for the whole segment (handed back if cut short)
    batch: _Rows | None = None  # a decode-only segment's rows as arrays
    lead: float = 0.0  # CPU the worker owed (its `debt`), paid before the first step

    def elapsed(self, n: int) -> float:
        return (self.lead if n > 0 else 0.0) + n * self.s0 + self.d * n * (n - 1) / 2

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.k)


class Hooks:
    """What a worker tells the cluster (the simulator implements it)."""

    def wake(self, worker: SimWorker, t: float) -> None:
        """The worker's step in flight now ends at `t`: call its `step_end(t, version)` then."""

    def kick(self, worker: SimWorker, t: float) -> None:
        """An idle worker has work: call its `kicked(t)` once everything else at `t` is done."""

    def chunk_done(self, seq: Seq, t: float) -> None:
        """A prefill order has `seq.computed` tokens computed at `t` (not yet all): the KV of
        its full blocks may start to move."""

    def prefill_done(self, seq: Seq, t: float) -> None:
        """A prefill order's prompt is computed at `t`: the rest of its KV moves (`release_held` after)."""

    def finished(self, track: Track, t: float) -> None:
        """The request's last token reached the client at `t`."""

    def stream_cpu(self, worker: SimWorker, per_step: float, steps: int) -> float:
        """`worker` starts `steps` steps each streaming tokens that cost `per_step` CPU seconds
        outside the engines: the part of each step's time the worker itself pays (0 when a
        core is idle for it; the cluster charges the rest to the other busy workers)."""
        return 0.0


class SimWorker:
    def __init__(self, wid: str, role: WorkerRole, engine: EngineSettings, costs: CostModel, hooks: Hooks) -> None:
        self.wid, self.role, self.engine, self.costs, self.hooks = wid, role, engine, costs, hooks
        self.pool = KVPool(engine.num_kv_blocks, engine.enable_prefix_caching)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.awaiting_kv = 0  # handoffs with blocks reserved here, KV not yet landed
        self.queued_prefill = 0
        self.step: _Step | None = None
        self.version = 0  # bumps whenever the step in flight changes: older wake-ups are stale
        self.preemptions = 0
        self.busy_s = 0.0
        self.debt = 0.0  # CPU seconds charged to this worker (host contention), paid by its next step
        self._kicked = False  # a start is due at the current instant

    @property
    def busy(self) -> bool:
        """In a step, or with work that starts one now: its engine thread holds a core."""
        return self.step is not None or bool(self.running) or bool(self.waiting)

    # -- what the router reads ------------------------------------------------------

    def free_blocks(self) -> int:
        """Free blocks as the worker reports them (a segment's advance allocation counts as free)."""
        ahead = sum(self.step.growth) if self.step is not None else 0
        return self.pool.free + ahead

    def matched_blocks(self, req: SimRequest) -> int:
        return self.pool.match(req.block_hashes, len(req.block_hashes))

    # -- what lands on the worker ------------------------------------------------------

    def enqueue(self, seq: Seq, t: float) -> None:
        """A request to prefill here (and decode, unless it is a prefill order)."""
        limit = (seq.target - 1) // self.engine.block_size
        cached = self.pool.match(seq.req.block_hashes, limit) * self.engine.block_size
        self._set_pending(seq, seq.target - cached)
        self.waiting.append(seq)
        self.poke(t)

    def reserve(self, seq: Seq, t: float) -> int | None:
        """Decode side of a handoff: blocks for the whole prompt, reusing this worker's cache.
        Returns the prompt tokens already cached here, or None (nothing changed) if short."""
        bs, req = self.engine.block_size, seq.req
        n = self.pool.match(req.block_hashes, (req.prompt_len - 1) // bs)
        hashes = req.block_hashes[:n]
        need = -(-req.prompt_len // bs) - n
        if not self.pool.can_take(hashes, need):
            self._cut(t)  # the segment in flight holds blocks for steps it has not run yet: end it
            if not self.pool.can_take(hashes, need):
                return None
        self.pool.take(seq.blocks, hashes, need)
        self.awaiting_kv += 1
        return n * bs

    def kv_arrived(self, seq: Seq, t: float) -> None:
        """The prompt's KV landed: the sequence decodes from the next step, ahead of new work."""
        self.awaiting_kv -= 1
        seq.computed = seq.target
        self.pool.cache(seq.blocks, seq.req.block_hashes[len(seq.blocks.hashed):])
        self.waiting.appendleft(seq)
        self.poke(t)

    def poke(self, t: float) -> None:
        """Something changed at `t`: an idle worker starts a step (once everything else that
        happens at `t` has landed: requests sent together start together); a segment ends at
        the next step boundary."""
        if self.step is None:
            if not self._kicked:
                self._kicked = True
                self.hooks.kick(self, t)
        else:
            self._cut(t)

    def kicked(self, t: float) -> None:
        """The cluster's event for `poke` on an idle worker."""
        self._kicked = False
        if self.step is None:
            self._start(t)

    def step_end(self, t: float, version: int) -> None:
        """The step in flight ended at `t` (the cluster's event; stale versions are ignored)."""
        if version != self.version or self.step is None:
            return
        step, self.step = self.step, None
        self.busy_s += step.end - step.start
        self._apply(step)
        self._start(step.end)

    # -- planning a step ---------------------------------------------------------------

    def _start(self, t: float) -> None:
        self.version += 1
        rows, chunks, preempted = self._schedule()
        if not rows and not chunks:
            self.step = None
            return
        ctx = sum(s.context for s in rows)
        s0 = self.costs.step_s([(n, s.computed) for s, n in chunks], len(rows), ctx)
        k, growth, batch = 1, self._grow(rows, 1), None
        if not chunks and not preempted:
            batch = _Rows.of(rows, self.engine)
            k = batch.steps(self.pool.free)
            growth = batch.growth(k)
        d = self.costs.decode_growth(len(rows), ctx, k) if not chunks else 0.0
        host = self.costs.host
        if host is not None and rows and host.serving_cpu_per_token_s > 0:
            s0 += self.hooks.stream_cpu(self, host.serving_cpu_per_token_s * len(rows) * self.engine.tokens_per_step, k)
        for s, g in zip(rows, growth):
            if g:
                self.pool.allocate(s.blocks, g)
        lead, self.debt = self.debt, 0.0
        self.step = _Step(t, rows, chunks, k, s0, d, growth, batch, lead)
        self.hooks.wake(self, self.step.end)

    def _schedule(self) -> tuple[list[Seq], list[tuple[Seq, int]], bool]:
        """This step's decode rows and prefill chunks (the module doc's policy); allocates the
        chunks' blocks, checks the rows' next step fits, preempts when it does not."""
        e = self.engine
        budget = e.max_num_batched_tokens
        rows: list[Seq] = []
        chunks: list[tuple[Seq, int]] = []
        need = 0  # blocks the rows need for their next step
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:  # bounded: i grows or running shrinks
            s = self.running[i]
            if s.decoding:
                n, blocks = min(e.row_tokens, budget), self._row_blocks(s, 1)
                ok = need + blocks <= self.pool.free
            else:
                n = min(s.target - s.computed, budget)
                blocks = max(0, -(-(s.computed + n) // e.block_size) - s.blocks.count)
                ok = need + blocks <= self.pool.free
            if not ok:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is s:
                    break
                continue
            if s.decoding:
                rows.append(s)
                need += blocks
            else:
                self.pool.allocate(s.blocks, blocks)
                chunks.append((s, n))
            budget -= n
            i += 1
        if not preempted:
            self._admit(rows, chunks, budget, need)
        return rows, chunks, preempted

    def _admit(self, rows: list[Seq], chunks: list[tuple[Seq, int]], budget: int, need: int) -> None:
        e, bs = self.engine, self.engine.block_size
        while self.waiting and budget > 0 and len(self.running) < e.max_num_seqs:  # bounded by waiting
            s = self.waiting[0]
            if s.decoding:  # its KV arrived from a prefill worker: it holds its blocks
                blocks = self._row_blocks(s, 1)
                if need + blocks > self.pool.free:
                    break
                rows.append(s)
                need += blocks
                n = min(e.row_tokens, budget)
            else:
                hit = self.pool.match(s.req.block_hashes, (s.target - 1) // bs)
                hashes = s.req.block_hashes[:hit]
                n = min(s.target - hit * bs, budget)
                fresh = -(-(hit * bs + n) // bs) - hit
                if not self.pool.can_take(hashes, fresh + need):
                    break
                self.pool.take(s.blocks, hashes, fresh)
                s.computed = hit * bs
                self._set_pending(s, s.target - s.computed)
                if not s.counted_cache:
                    s.counted_cache = True
                    if s.kind is not SeqKind.REMOTE:
                        s.track.cached_tokens = s.computed
                chunks.append((s, n))
            self.waiting.popleft()
            self.running.append(s)
            budget -= n

    def _row_blocks(self, s: Seq, steps: int) -> int:
        """Fresh blocks a decoding sequence needs to hold its context after `steps` more steps."""
        e, b = self.engine, s.blocks  # the hot path: one call per row per step planned
        tokens = s.track.req.prompt_len + s.generated + steps * e.tokens_per_step
        return max(0, math.ceil(tokens / e.block_size - 1e-9) - len(b.hashed) - b.private)

    def _grow(self, rows: list[Seq], steps: int) -> list[int]:
        return [self._row_blocks(s, steps) for s in rows]

    def _cut(self, t: float) -> None:
        """End the segment in flight at the first step boundary at or after `t`."""
        step = self.step
        if step is None or step.k <= 1 or t >= step.end:
            return
        n = self._steps_by(step, t - step.start)
        if n >= step.k:
            return
        new_growth = step.batch.growth(n) if step.batch is not None else self._grow(step.rows, n)
        for s, had, keep in zip(step.rows, step.growth, new_growth):
            give = had - keep
            s.blocks.private -= give
            self.pool.private -= give
        step.k, step.growth = n, new_growth
        self.version += 1
        self.hooks.wake(self, step.end)

    @staticmethod
    def _steps_by(step: _Step, dt: float) -> int:
        """The fewest whole steps that reach `dt` into the segment (at least 1: the one running)."""
        dt_steps = max(0.0, dt - step.lead)
        if step.d > 0:
            a, b = step.d / 2, step.s0 - step.d / 2
            n = math.ceil((-b + math.sqrt(b * b + 4 * a * dt_steps)) / (2 * a))
        else:
            n = math.ceil(dt_steps / step.s0) if step.s0 > 0 else 1
        n = max(1, n)
        for _ in range(3):  # float slack: settle on the exact boundary
            if n > 1 and step.elapsed(n - 1) >= dt:
                n -= 1
            elif step.elapsed(n) < dt:
                n += 1
        return n

    # -- applying a finished step -----------------------------------------------------------

    def _apply(self, step: _Step) -> None:
        e, end = self.engine, step.end
        for s, n in step.chunks:
            s.computed += n
            self._set_pending(s, s.pending - n)
            full = min(s.computed // e.block_size, len(s.req.block_hashes))
            self.pool.cache(s.blocks, s.req.block_hashes[len(s.blocks.hashed):full])
            if s.decoding:
                self._prefilled(s, end)
            elif s.kind is SeqKind.PREFILL_ORDER:
                self.hooks.chunk_done(s, end)
        if step.rows:
            times: float | np.ndarray = end
            if step.k > 1:
                times = step.start + step.lead + np.cumsum(step.s0 + step.d * np.arange(step.k))
                times[-1] = end  # the closed form's end, to the last bit: the sequence's `done`
            gained = step.k * e.tokens_per_step
            for s in step.rows:
                s.generated = min(float(s.req.output_len), s.generated + gained)
                s.track.chunks.append(times)
                if s.generated >= s.req.output_len - 1e-9:
                    self._finish(s, end)

    def _prefilled(self, s: Seq, t: float) -> None:
        if s.kind is SeqKind.PREFILL_ORDER and s.req.output_len > 1:
            self.running.remove(s)  # it holds its KV until the transfer ends (`release_held`)
            self.hooks.prefill_done(s, t)
            return
        s.generated += 1
        s.track.emit(t)
        if s.generated >= s.req.output_len - 1e-9:
            self._finish(s, t)

    def _finish(self, s: Seq, t: float) -> None:
        self.running.remove(s)
        self.pool.release(s.blocks)
        self.hooks.finished(s.track, t)

    def release_held(self, s: Seq, t: float) -> None:
        """A prefill order's KV has been sent: its blocks go back (cached) to the pool."""
        self.pool.release(s.blocks)
        self.poke(t)

    def _preempt(self, s: Seq) -> None:
        self.preemptions += 1
        self.pool.release(s.blocks)
        s.target = s.req.prompt_len + int(s.generated) if s.generated else s.req.prompt_len
        s.computed = 0
        self._set_pending(s, s.target)
        self.waiting.appendleft(s)

    def _set_pending(self, s: Seq, v: int) -> None:
        v = max(0, v)
        self.queued_prefill += v - s.pending
        s.pending = v

