"""`pdserve profile`'s measurements: one worker's engine, timed step by step.

The engine is built as a worker builds it (cluster/actors.py `_engine`: on a
thread that exits, with the worker's torch thread count), and every
measurement then runs on one other thread, as a worker's engine thread steps
it. Each point times `LLMEngine.step()` whole (scheduling, the model,
sampling, outputs), the median of `repeats` (at most 3 where a step takes
over a second) after one untimed warm-up of the same shape (a compiled model
may specialise on a new token count).

- prefill: one prompt of `new` fresh tokens, all in one step (`new` <= the
  step's token budget: the chunk sizes the scheduler makes), after `cached`
  tokens the prefix cache already holds (the start of one long prompt
  computed once, untimed: a prefix-cache hit, or the chunks before this one);
  the point records what the engine reports it reused and computed.
- decode: `batch` requests at a context, set up the way a decode worker
  receives them (reserve blocks, then the prompt's KV "arrives": no prefill
  is run; the values in the blocks do not change the time), then `steps`
  pure decode steps. Their contexts average the point's context.
- transfer: profile_transfer.py.
- speculation (when the engine drafts): a short greedy run of a text prompt;
  acceptance and tokens per decode row per step from the engine's counters.
  The decode points are then the engine's real steps: up to
  `spec_max_batch_size` rows (in the notes) they verify drafts.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Unpack

from pdserve.cluster.planner.profile import (
    MIN_POINTS,
    DecodePoint,
    EngineShape,
    ModelInfo,
    PointAt,
    PrefillPoint,
    Profile,
    ProfileNotes,
    SpecProfile,
    Spread,
    TransferPoint,
    machine_info,
)
from pdserve.cluster.planner.profile_transfer import kv_bytes_per_token, measure_transfer
from pdserve.workers.config import EngineConfig
from pdserve.workers.cpu_threads import run_on_exiting_thread
from pdserve.workers.engine import LLMEngine
from pdserve.workers.model.packed_linear import num_parameters
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.stats import StepStats
from pdserve.workers.transfer.base import Transport

Progress = Callable[[str], None]
_DECODE_WARMUP_STEPS = 2
_LONG_STEP_S, _LONG_STEP_REPEATS = 1.0, 3
# A text with repeats, so prompt lookup (ngram) has something to find, as in code or chat.
_SPEC_PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
                "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\ndef ")


@dataclass(frozen=True)
class Grid:
    """The points to measure. Lengths that do not fit the engine (its step budget,
    max_model_len, KV pool) are dropped when the grid is fitted to it (`fit`)."""

    prefill_tokens: tuple[int, ...]  # new tokens per step, nothing cached
    cached: tuple[tuple[int, int], ...]  # (cached prefix, new tokens): prefix-cache hits, later chunks
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    transfer_tokens: tuple[int, ...]
    repeats: int = 5
    decode_steps: int = 7  # odd: the middle step's context is the point's (at most 3 once a step takes > 1 s)
    # Batches stop growing at a context once a step takes longer than this: the
    # larger ones would be slower still (time runs out before KV capacity does).
    max_step_s: float = 2.0
    spec_tokens: int = 64  # tokens generated to measure speculation

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "batches", "contexts", "transfer_tokens"):
            values = getattr(self, name)
            if any(type(v) is not int or v <= 0 for v in values) or (not values and name != "transfer_tokens"):
                raise ValueError(f"{name}: one or more positive integers, got {values}")
        if any(c < 0 or n <= 0 for c, n in self.cached):
            raise ValueError(f"cached: (cached >= 0, new > 0) pairs, got {self.cached}")
        for name in ("repeats", "decode_steps", "spec_tokens"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.max_step_s > 0:
            raise ValueError(f"max_step_s: must be > 0, got {self.max_step_s}")

    @classmethod
    def default(cls, quick: bool = False) -> Grid:
        """Lengths for a first look (`quick`) or a profile a planner can trust; `fit` trims them."""
        if quick:
            return cls(prefill_tokens=(16, 64, 256), cached=((256, 64),), batches=(1, 4, 16), contexts=(64, 256),
                       transfer_tokens=(16, 256, 1024), repeats=3, decode_steps=3, spec_tokens=32)
        return cls(prefill_tokens=(16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                   cached=((512, 64), (2048, 64), (4096, 64), (512, 512), (2048, 512), (4096, 512), (1024, 1024)),
                   batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), contexts=(128, 512, 2048, 8192),
                   transfer_tokens=(16, 64, 256, 1024, 4096))

    def fit(self, engine: LLMEngine) -> Grid:
        """This grid within what `engine` can run: prompts within one step's budget and
        max_model_len (a cached prefix cut to fit; none without prefix caching), batches
        within max_num_seqs, lengths in whole blocks where a prefix must be cached or KV
        moved. The budget itself is always a prefill point (the chunk a long prompt's
        every step but its last computes)."""
        cfg, mml = engine.config, engine.max_model_len
        budget, bs = cfg.max_num_batched_tokens, cfg.block_size
        prefill = {n for n in self.prefill_tokens if n <= budget and n < mml}
        if max(self.prefill_tokens) >= budget:
            prefill.add(min(budget, mml - 1))
        # A prefix too long for the model is cut to what fits: the longest contexts are the ones to cover.
        cached = {(min(c, mml - n - 1) // bs * bs, n) for c, n in self.cached
                  if n <= budget and n < mml - bs and cfg.enable_prefix_caching}
        batches = {b for b in self.batches if b <= cfg.max_num_seqs}
        if max(self.batches) >= cfg.max_num_seqs:
            batches.add(cfg.max_num_seqs)
        spec_k = cfg.num_speculative_tokens if cfg.speculative else 0
        room = (self.decode_steps + _DECODE_WARMUP_STEPS + 2) * (1 + spec_k)  # what a row grows by while timed
        contexts = {min(c, (mml - room) // bs * bs) for c in self.contexts}
        # A handoff moves one request's KV: at most max_model_len tokens (a longer one is cut to that).
        transfer = {max(bs, min(n, mml, engine.num_kv_blocks * bs) // bs * bs) for n in self.transfer_tokens}
        return dataclasses.replace(self, prefill_tokens=tuple(sorted(prefill)), cached=tuple(sorted(cached)),
                                   batches=tuple(sorted(batches)), contexts=tuple(sorted(c for c in contexts if c > 0)),
                                   transfer_tokens=tuple(sorted(transfer)))


def build_engine(config: EngineConfig, torch_threads: int) -> LLMEngine:
    """The engine as a worker builds it (cluster/actors.py `_engine`; not imported from
    there: that module imports Ray): on a thread that exits, so the thread that then
    steps it is the process's only OpenMP master (workers/cpu_threads.py). A worker
    records KV events for the router; so does this one (drained at every point). Its steps are
    synchronous: each `step()` is timed as one whole step (with async scheduling, the CUDA
    default, a step returns the outputs of the one before, and the host's share of it
    overlaps the next: these times are then an upper bound)."""
    import torch

    torch.set_num_threads(torch_threads)
    config = dataclasses.replace(config, record_kv_events=True, async_scheduling=False)
    return run_on_exiting_thread(lambda: LLMEngine(config), torch_threads)


def profile_engine(engine: LLMEngine, grid: Grid, transport: Transport, torch_threads: int,
                   progress: Progress, model_name: str | None = None) -> Profile:
    """Every measurement on one thread (as a worker's engine thread steps), then the profile.
    `model_name`: what the model is served as (default: the engine's `model` setting)."""
    grid = grid.fit(engine)
    _check_enough_points(grid)
    profiler = _Profiler(engine, grid, progress)

    def measure() -> tuple[list[PrefillPoint], list[DecodePoint], list[TransferPoint], SpecProfile | None]:
        prefill = profiler.prefill()
        decode = profiler.decode()
        transfer = measure_transfer(engine, transport, grid.transfer_tokens, grid.repeats, progress)
        return prefill, decode, transfer, profiler.speculation()

    load_before = os.getloadavg()  # other work on the machine moves the times: the reader should know
    prefill, decode, transfer, speculative = run_on_exiting_thread(measure, torch_threads, name="pdserve-profile")
    notes: ProfileNotes = {"grid": dataclasses.asdict(grid), "skipped": profiler.skipped, "spread": profiler.spread,
                           "decode_warmup_steps": _DECODE_WARMUP_STEPS,
                           "load_average": {"before": load_before, "after": os.getloadavg()}}
    if speculative is not None:  # decode steps up to this batch verify drafts: they gain tokens_per_step each
        notes["spec_max_batch_size"] = engine.config.spec_max_batch_size
    return Profile(machine=machine_info(str(engine.device)), model=model_info(engine, model_name),
                   engine=engine_shape(engine, torch_threads), transport=transport.value,
                   kv_bytes_per_token=kv_bytes_per_token(engine), prefill=tuple(prefill), decode=tuple(decode),
                   transfer=tuple(transfer), speculative=speculative,
                   created=datetime.now(UTC).isoformat(timespec="seconds"), notes=notes)


def _check_enough_points(grid: Grid) -> None:
    """ValueError unless the fitted grid can make a profile (`Profile` checks the points): refused
    here, before the minutes of measuring, not after them with every measurement lost."""
    prefill, decode = len(grid.prefill_tokens) + len(grid.cached), len(grid.batches) * len(grid.contexts)
    if prefill < MIN_POINTS:
        raise ValueError(f"grid: a profile needs >= {MIN_POINTS} prefill points; fitted to this engine (its step "
                         f"budget, max_model_len) the grid has {prefill}: {grid.prefill_tokens} new tokens, "
                         f"{len(grid.cached)} cached prefixes (--prefill-tokens, --cached)")
    if decode < MIN_POINTS:
        raise ValueError(f"grid: a profile needs >= {MIN_POINTS} decode points; fitted to this engine the grid has "
                         f"{decode}: batches {grid.batches} x contexts {grid.contexts} (--batches, --contexts)")


def model_info(engine: LLMEngine, name: str | None = None) -> ModelInfo:
    mc = engine.full_model_config  # the whole model, whatever its ranks hold
    return {"path": engine.model_dir, "name": name or engine.config.model, "architecture": mc.arch,
            "layers": mc.num_layers, "hidden_size": mc.hidden_size, "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "vocab_size": mc.vocab_size,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "parameters": num_parameters(engine.model)}  # rank 0's shard's, of a tensor-parallel worker


def engine_shape(engine: LLMEngine, torch_threads: int) -> EngineShape:
    cfg = engine.config
    return EngineShape(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, num_kv_blocks=engine.num_kv_blocks,
                       max_model_len=engine.max_model_len, torch_threads=torch_threads,
                       dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device),
                       enable_prefix_caching=cfg.enable_prefix_caching, tensor_parallel_size=engine.tp.size)


class _Profiler:
    """The engine measurements, run on the engine's one thread."""

    def __init__(self, engine: LLMEngine, grid: Grid, progress: Progress) -> None:
        self.engine, self.grid, self.progress = engine, grid, progress
        self.rng = random.Random(0)
        self._ids = iter(range(1 << 62))
        self.last_step: StepStats | None = None
        engine.step_observers.append(self._observe)
        self.skipped: list[str] = []  # points left out, and why
        self.spread: list[Spread] = []  # per point: min and max of the repeats (noise, for the reader)

    def _observe(self, step: StepStats) -> None:
        self.last_step = step

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self) -> list[PrefillPoint]:
        points = [self._prefill_point([], n) for n in self.grid.prefill_tokens]
        if not self.grid.cached:
            return points
        # One prompt computed once (untimed) caches every prefix the cached points start with:
        # computing each prefix on its own would cost more than the points themselves.
        base = self._tokens(max(c for c, _ in self.grid.cached))
        self._run_to_end(base)  # freed, still cached: the blocks each point reuses are touched, so kept
        return points + [self._prefill_point(base[:c], n) for c, n in self.grid.cached]

    def _prefill_point(self, prefix: list[int], new: int) -> PrefillPoint:
        cached = len(prefix)
        runs = [self._prefill_step(prefix + self._tokens(new))]  # warm-up
        # A step over a second varies less, relative to itself, than a short one: fewer repeats do.
        repeats = self.grid.repeats if runs[0][0] < _LONG_STEP_S else min(self.grid.repeats, _LONG_STEP_REPEATS)
        runs = [self._prefill_step(prefix + self._tokens(new)) for _ in range(repeats)]
        seconds = statistics.median(t for t, _ in runs)
        got = runs[-1][1]  # what the engine reused: the whole prefix, unless it was evicted
        point = PrefillPoint(new_tokens=cached + new - got, cached_tokens=got, seconds=seconds)
        self._note("prefill", [t for t, _ in runs], new=point.new_tokens, cached=got)
        self.progress(f"prefill {point.new_tokens:>6} new after {got:>6} cached: {seconds * 1e3:9.2f} ms")
        return point

    def _prefill_step(self, prompt: list[int]) -> tuple[float, int]:
        """One step that prefills `prompt` whole and samples its one token: (seconds, cached tokens)."""
        rid = self._rid("prefill")
        self.engine.add_request(rid, prompt, _params(1))
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        out = next((o for o in outputs if o.request_id == rid), None)
        if out is None or not out.finished or self.engine.has_unfinished_requests():
            raise RuntimeError(f"a {len(prompt)}-token prompt did not prefill in one step")
        self._drain()
        return seconds, out.num_cached_tokens

    def _run_to_end(self, prompt: list[int]) -> None:
        self.engine.add_request(self._rid("prefix"), prompt, _params(1))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self._drain()

    # -- decode --------------------------------------------------------------------------------

    def decode(self) -> list[DecodePoint]:
        points = []
        for context in self.grid.contexts:
            timed = self.grid.decode_steps
            for batch in self.grid.batches:
                point = self._decode_point(batch, context, timed)
                if point is None:
                    break
                points.append(point)
                if point.seconds > self.grid.max_step_s:
                    self._skip(f"decode context {context}: batches above {batch} (a step took "
                               f"{point.seconds:.2f} s > max_step_s {self.grid.max_step_s:g})")
                    break
                if point.seconds > _LONG_STEP_S:  # the next batch's steps are longer still: fewer of them
                    timed = min(timed, _LONG_STEP_REPEATS)
        return points

    def _decode_point(self, batch: int, context: int, timed: int) -> DecodePoint | None:
        """`batch` rows decoding at `context` (averaged over `timed` steps); None where the pool cannot hold them."""
        spec_k = self.engine.config.num_speculative_tokens if self.engine.spec is not None else 0
        steps = _DECODE_WARMUP_STEPS + timed
        prompt_len = context - _DECODE_WARMUP_STEPS - (timed + 1) // 2
        # Room for every step's drafts too: a row that runs out of blocks would preempt another.
        row_blocks = -(-(prompt_len + 1 + steps * (1 + spec_k)) // self.engine.config.block_size)
        if batch * row_blocks > self.engine.kv.pool.num_free:
            self._skip(f"decode batch {batch} at context {context}: {batch * row_blocks} blocks > the pool's "
                       f"{self.engine.kv.pool.num_free}")
            return None
        rids = self._decoding_rows(batch, prompt_len, _params(1 + steps * (1 + spec_k) + 1))
        times = []
        try:
            for i in range(steps):
                start = time.perf_counter()
                self.engine.step()
                seconds = time.perf_counter() - start
                step = self.last_step
                if step is None or step.prefill_tokens or step.decode_seqs != batch:
                    raise RuntimeError(f"decode batch {batch} at context {context}: a step was not "
                                       f"{batch} decode rows ({step})")
                if i >= _DECODE_WARMUP_STEPS:
                    times.append(seconds)
        finally:
            self.engine.abort(rids, output=False)
            self._drain()
        seconds = statistics.median(times)
        self._note("decode", times, batch=batch, context=context)
        self.progress(f"decode batch {batch:>4} at context {context:>6}: {seconds * 1e3:9.2f} ms")
        return DecodePoint(batch=batch, context=context, seconds=seconds)

    def _decoding_rows(self, batch: int, prompt_len: int, params: SamplingParams) -> list[str]:
        """`batch` requests as a decode worker gets them: blocks reserved, then their prompt's
        KV "arrived" with a first token; each decodes from the next step."""
        rids = [self._rid("decode") for _ in range(batch)]
        for rid in rids:
            if self.engine.reserve(rid, self._tokens(prompt_len), params) is None:
                self.engine.abort(rids, output=False)
                raise RuntimeError(f"decode batch {batch}: the pool refused a reservation it had room for")
            self.engine.complete_reservation(rid, self._tokens(1)[0])
        return rids

    # -- speculation ---------------------------------------------------------------------------------

    def speculation(self) -> SpecProfile | None:
        """Acceptance and tokens gained per decode row per step, over a short greedy run of one request."""
        engine = self.engine
        if engine.spec is None or engine.config.speculative is None:
            return None
        before = dataclasses.replace(engine.stats)
        engine.add_request(self._rid("spec"), _SPEC_PROMPT, _params(self.grid.spec_tokens))
        rows = tokens = 0
        while engine.has_unfinished_requests():
            generated = engine.stats.generation_tokens
            engine.step()
            step = self.last_step
            if step is not None and not step.prefill_tokens and step.decode_seqs:
                rows += step.decode_seqs
                tokens += engine.stats.generation_tokens - generated
        self._drain()
        drafted = engine.stats.spec_draft_tokens - before.spec_draft_tokens
        accepted = engine.stats.spec_accepted_tokens - before.spec_accepted_tokens
        spec = SpecProfile(method=engine.config.speculative.value,
                           num_speculative_tokens=engine.config.num_speculative_tokens,
                           acceptance_rate=accepted / drafted if drafted else 0.0,
                           tokens_per_step=tokens / rows if rows else 1.0)
        self.progress(f"speculative {spec.method}: {drafted} drafted, {accepted} accepted "
                      f"({spec.acceptance_rate:.2f}); {spec.tokens_per_step:.2f} tokens per row per step")
        return spec

    # -- helpers ---------------------------------------------------------------------------------------

    def _tokens(self, n: int) -> list[int]:
        """`n` random token ids: no two prompts share a block, so nothing is cached by chance."""
        vocab = self.engine.model_config.vocab_size
        return [self.rng.randrange(vocab) for _ in range(n)]

    def _rid(self, kind: str) -> str:
        return f"profile-{kind}-{next(self._ids)}"

    def _drain(self) -> None:
        # Harmless now: the events sit in a bounded log (workers/kv/event_log.py) that routers
        # read without consuming; this moves the profiler's own cursor past them.
        self.engine.take_kv_events()

    def _skip(self, why: str) -> None:
        self.skipped.append(why)
        self.progress(f"skipped: {why}")

    def _note(self, kind: str, times: list[float], **where: Unpack[PointAt]) -> None:
        self.spread.append({"kind": kind, **where, "min": min(times), "max": max(times), "n": len(times)})


def _params(max_tokens: int) -> SamplingParams:
    """Greedy, no stop but the length, no text: the step's work is the model's and the sampler's."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
