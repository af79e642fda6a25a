"""The single-worker engine: `add_request`, `step`, `abort`.

A step is: schedule -> run the model on the scheduled tokens -> append what
was sampled (stop checks, text) -> outputs. Prefill and decode workers drive
this same loop; `pdserve.LLM` wraps it for offline use. Everything known of a
request lives on its `Request`; the scheduler owns where it stands.

The handoff between workers adds, on the decode side, `reserve` (blocks for a
prompt whose KV another worker computes), then `complete_reservation` (the KV
landed: decode from the prefill worker's first token) or `prefill_locally`
(it did not); on the prefill side, `hold_kv` requests keep their blocks when
they finish until `release`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Literal

import numpy as np
import torch
from transformers import AutoTokenizer

from pdserve.workers import cuda_graphs, row_faults
from pdserve.workers import engine_setup as setup
from pdserve.workers.bad_words import bad_words_token_ids, banned_by_words
from pdserve.workers.config import EngineConfig
from pdserve.workers.cpu_lending import CpuLending
from pdserve.workers.cpu_turns import CpuTurns
from pdserve.workers.detokenizer import IncrementalDetokenizer
from pdserve.workers.grammar import GrammarCompiler, GrammarStats
from pdserve.workers.handoff import LogprobEntry, Resume
from pdserve.workers.in_flight import InFlight, TokenFeed, chains, launch_record
from pdserve.workers.inputs import check_request, check_token_ids, max_new_tokens, truncate_prompt
from pdserve.workers.kv.cache import allocate_kv_caches
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.kv.events import KVEvent
from pdserve.workers.lifecycle import Lifecycle, RequestState
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.loader import load_model
from pdserve.workers.model.resolve import resolve_model
from pdserve.workers.model.tensor_parallel import TensorParallel, shard_config
from pdserve.workers.model_runner import ModelRunner, SpecResult, StepResult
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.request import FinishReason, Request
from pdserve.workers.sampler import NO_TOKEN, SamplerOutput
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.workers.stats import EngineSnapshot, EngineStats, StepStats
from pdserve.workers.token_append import (
    append_token,
    logprob_entries,
    record_prompt_logprobs,
    request_output,
    resume_output,
)
from pdserve.workers.tp_group import Plan, TPGroup, TPGroupError
from pdserve.workers.transfer.frames import KVCaches

# Re-exported: callers knew them from here.
__all__ = ["EngineStats", "LLMEngine", "StepStats"]


log = logging.getLogger(__name__)

# How long an engine with nothing else to run waits, per step, for a request's grammar to compile.
GRAMMAR_POLL_S = 0.005
# A grammar that takes longer to compile is refused (a 400), not left to stall its request.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
# The engine's own request when it checks that it can still run a step (`_engine_runs`).
_PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class LLMEngine:
    """One worker's engine. Single-threaded: one thread calls everything (a
    worker's `AsyncEngine` owns that thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.tp_group: TPGroup | None = None
        # OpenMP's thread count is per thread, and the build sets this engine's share on the
        # caller's (`plan_threads`, to compile for it): the caller gets its own back, or an engine
        # built here later takes the last one's share for all the cores it has (a one-rank LLM
        # after a two-rank one stepped on one thread of two). `step` sets the share where it runs.
        caller_threads = torch.get_num_threads()
        try:
            self._build(config)
        except BaseException as e:
            # Ranks started for an engine that failed to start: stopped now, not when the
            # traceback lets go of this object (a retry would find their group still up).
            self._abandon(e)
            raise
        finally:
            torch.set_num_threads(caller_threads)

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        self.device = setup.resolve_device(config.device)
        probe = setup.memory_probe(self.device)  # before anything is allocated on the device
        # `model` may name a GGUF file or `tiny`: the directory it stands for (converted once, cached).
        model_dir = str(resolve_model(config.model, progress=config.progress))
        self.model_dir = model_dir
        full_config = ModelConfig.from_pretrained(model_dir)
        self.dtype = setup.resolve_model_dtype(config.dtype, full_config, self.device)
        self.max_model_len = setup.resolve_max_model_len(config.max_model_len, full_config)
        backend = config.attention_backend.resolve(self.device)
        quantization = setup.resolve_quantization(config.quantization, full_config)
        # More than one rank: the ranks of a torchrun (each runs this engine), or this engine as
        # rank 0 of processes it starts now, which load their shards while this one loads its own
        # (workers/tp_group.py). The model here is this rank's shard: what the KV cache, the
        # memory plan and the kernels see.
        self.tp_group = setup.start_tp_group(config, full_config, model_dir, self.dtype, self.device, backend,
                                             self.max_model_len, quantization, setup.measures_memory(config, probe))
        self.tp = self.tp_group.tp if self.tp_group is not None else TensorParallel.from_world(
            config.tensor_parallel_size)
        self.full_model_config = full_config  # the whole model's (what a KV transfer moves, a profile reports)
        self.model_config = shard_config(full_config, self.tp)
        torch.manual_seed(config.seed)
        setup.log(config, f"loading {config.model} ({self.model_config.arch}, {self.dtype}, {self.device})")
        self.tokenizer = AutoTokenizer.from_pretrained(setup.tokenizer_source(config.tokenizer, model_dir))
        self.model = load_model(model_dir, full_config, self.dtype, self.device, backend,
                                self.max_model_len, progress=config.progress, quantization=quantization, tp=self.tp)
        # The draft's weights and its KV (per block) count before the pool is sized.
        draft = setup.load_draft(config, self.model_config, self.dtype, self.device, backend, self.max_model_len,
                                 self.tokenizer)
        memory = setup.measure_memory(config, probe, self.model, draft, self.dtype, self.device, self.max_model_len,
                                      self.tp_group)
        self.num_kv_blocks, self.max_model_len = setup.plan_kv(
            config, self.model_config, self.dtype, self.device, self.max_model_len,
            draft=draft.config if draft is not None else None, memory=memory)
        kv_dtype = setup.kv_cache_dtype(config, self.dtype)
        # A tensor-parallel engine's ranks keep their caches in one shared file, which its KV
        # transfers read and write whole from here (workers/kv/shared_cache.py).
        self._shared_kv = (self.tp_group.share_kv(full_config, self.num_kv_blocks, config.block_size, kv_dtype)
                           if self.tp_group is not None and self.device.type == "cpu" else None)
        self.kv_caches = (list(self._shared_kv.ranks[0]) if self._shared_kv is not None else allocate_kv_caches(
            self.model_config, self.num_kv_blocks, config.block_size, kv_dtype, self.device))
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 record_events=config.record_kv_events)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv)
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv, config.max_num_batched_tokens,
                                  config.max_num_seqs, self.max_model_len, self.device)
        threads, lending, thread_counts = setup.plan_threads(config, self.model, self.dtype, self.tp_group,
                                                             self._has_steps_to_run)
        # The share this engine steps on (and compiled for); its engine thread sets it for itself.
        self.torch_threads = threads
        if self.tp_group is not None:
            self.runner.tp_group = self.tp_group
            self.tp_group.send_plan(Plan(self.num_kv_blocks, not config.enforce_eager and self.device.type == "cpu",
                                         thread_counts, shared_kv=self._shared_kv is not None,
                                         graphs=cuda_graphs.wanted(config, self.device, backend),
                                         max_model_len=self.max_model_len))
        setup.compile_runner(config, self.runner, backend, self.max_model_len, thread_counts)
        setup.prepare_attention(config, backend, self.device)
        self.runner.graphs = cuda_graphs.capture(config, self.runner, backend, lambda msg: setup.log(config, msg),
                                                 fallback=self.tp_group is None)
        self.stats = EngineStats()
        # Called on the engine thread after every step that ran the model; keep them cheap.
        self.step_observers: list[Callable[[StepStats], None]] = []
        self.spec = setup.make_speculator(config, draft, self.dtype, self.device, backend, self.num_kv_blocks,
                                          self.max_model_len, thread_counts, self.model_config.vocab_size)
        self._eos_token_ids = self._eos_ids()
        # Async scheduling (workers/in_flight.py): the step launched and not yet landed. With a
        # speculator only while it drafts nothing: drafts come from the last step's accepted tokens
        # on the host.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda") and self.tp_group is None
        self._in_flight: InFlight | None = None
        self.overlapped_steps = 0  # steps launched while the one before was in flight
        self._aborted_outputs: list[RequestOutput] = []
        self._fault_outputs: list[RequestOutput] = []  # this step's requests failed alone (`_fault`)
        self._fault_streak = 0  # steps in a row in which every scheduled request was failed alone
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self._grammars_lock = threading.Lock()  # `validate` may run on another thread than the engine's
        # Turns at the cores with the other engines on this machine (workers/cpu_turns.py), or
        # lending them (workers/cpu_lending.py), if any.
        self.cpu_turn: AbstractContextManager[object] = (CpuTurns(config.cpu_turns) if config.cpu_turns
                                                         else lending or contextlib.nullcontext())
        setup.log(config, f"KV cache: {self.num_kv_blocks} blocks of {config.block_size} tokens; "
                          f"max_model_len {self.max_model_len}")

    @property
    def transfer_kv(self) -> KVCaches:
        """The KV cache as KV transfers read and write it: the model's full heads (a tensor-parallel
        engine's: every rank's part, workers/kv/shared_cache.py). ValueError where this engine's
        ranks' caches are out of reach (private: /dev/shm had no room; a torchrun's ranks)."""
        if self._shared_kv is not None:
            return self._shared_kv
        if self.tp_group is not None and self.device.type == "cuda":  # the followers' over CUDA IPC
            return self.tp_group.device_kv(self.kv_caches, self.full_model_config)
        if self.tp.size > 1:
            raise ValueError("KV transfer: this tensor-parallel engine's ranks keep private KV caches (no room in "
                             "/dev/shm for shared ones, or ranks started by torchrun): it cannot send or take KV")
        return self.kv_caches

    def _abandon(self, error: BaseException) -> None:
        """A start that failed: its ranks killed, not told to stop, since they may wait in a
        start-up collective (a graph's capture) this rank never reached."""
        if self.tp_group is not None:
            self.tp_group.mark_broken(error)
        self.close()

    def close(self) -> None:
        """Stop this engine's other tensor-parallel ranks, if it started any (idempotent). Nothing
        else here needs closing: the rest is memory."""
        if self.tp_group is not None:
            self.tp_group.close()

    @property
    def shares_cores_by_step(self) -> bool:
        """Whether this engine takes turns at its node's cores, or lends them, step by step."""
        return not isinstance(self.cpu_turn, contextlib.nullcontext)

    # -- requests -------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    hold_kv: bool = False, resume: Resume | None = None, life: Lifecycle | None = None) -> None:
        """Queue a request. Raises ValueError (changing nothing) on bad input.

        `hold_kv` (prefill worker): when the request finishes, its blocks stay
        allocated until `release(request_id)`, so their KV can be sent.
        `resume`: a request that another worker started and lost (it died); its
        output so far is taken as this one's, computed again with the prompt, and
        its outputs go on after it.
        `life`: the worker's lifecycle of the request, which the scheduler moves from
        here on and the worker ends (None: the engine's own, ended when it finishes).
        """
        req = self._new_request(request_id, prompt, params, hold_kv, life)
        if resume is not None:
            resume_output(req, resume, self.model_config.vocab_size)
        self.scheduler.add(req)

    def validate(self, prompt: str | list[int], params: SamplingParams, grammar: bool = True) -> None:
        """Raise ValueError if add_request would reject this prompt and params. A grammar
        (structured outputs) is compiled here, on the caller's thread (it is cached: the
        engine thread then finds it ready), within GRAMMAR_COMPILE_TIMEOUT_S; `grammar`
        False: not (a caller on an event loop awaits the compiler's `ready` first)."""
        self._prepare(prompt, params)
        if grammar and params.constraint is not None:
            try:
                self.grammar_compiler().wait(params.constraint, GRAMMAR_COMPILE_TIMEOUT_S)
            except TimeoutError:
                raise ValueError(too_slow(params)) from None


    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, made on first use (the tokenizer's vocabulary is
        read then); any thread."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self._eos_token_ids)
            return self._grammars

    def abort(self, request_ids: str | Iterable[str], output: bool = True) -> None:
        """Stop requests now, wherever they are (held ones included); their blocks
        are freed before this returns. Unknown ids are ignored. The next `step`
        returns each one's final output (finish_reason "abort") unless `output` is
        False (a caller that told its client already: the id may be reused at once)."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if not req.finished:
                self.scheduler.finish(req, FinishReason.ABORT)
                if output:
                    self._aborted_outputs.append(request_output(req))
            self.scheduler.release(rid)
        if self.spec is not None:  # a draft model's KV of them: their ids may be reused at once
            self.spec.proposer.retain({r.request_id for r in self.scheduler.running})
        if self._in_flight is not None and all(s.request.finished for s in self._in_flight.sched.scheduled):
            # Nothing of it is wanted now: dropped unread (the device finishes it before any later
            # step reuses its blocks), so that an engine with nothing left has nothing unfinished.
            self._in_flight = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def in_flight(self) -> bool:
        """Whether a step is launched and not landed: the next `step` returns its outputs."""
        return self._in_flight is not None

    def _has_steps_to_run(self) -> bool:
        """Requests a step can run now (not those waiting for their KV from a prefill worker)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def cpu_idle(self) -> None:
        """Nothing to step: a lending engine leaves its node's cores to its neighbours
        (workers/cpu_lending.py). Cheap; a no-op otherwise."""
        if isinstance(self.cpu_turn, CpuLending):
            self.cpu_turn.idle()

    # -- the handoff ----------------------------------------------------------

    def reserve(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                life: Lifecycle | None = None) -> tuple[list[int], int] | None:
        """Decode worker: reserve blocks for a prompt whose KV a prefill worker
        will write. Returns (block ids covering the prompt, tokens this worker
        already caches: those blocks need no transfer), or None when the pool
        cannot hold it now (nothing changed). Then `complete_reservation`,
        `prefill_locally` or `abort`. `life` as in `add_request`: ROUTED, it moves
        to TRANSFERRING once the blocks are reserved."""
        own = life is None  # a reservation starts ROUTED, as a decode worker's request does
        req = self._new_request(request_id, prompt, params, False,
                                Lifecycle(request_id, math.inf, RequestState.ROUTED) if own else life, own)
        try:
            plan = self.scheduler.reserve_remote(req)
        except BaseException:
            self.stats.prompt_tokens -= req.num_prompt_tokens
            raise
        if plan is None:
            self.stats.prompt_tokens -= req.num_prompt_tokens
        return plan

    def complete_reservation(self, request_id: str, first_token: int, first_logprobs: LogprobEntry | None = None,
                             prompt_logprobs: list[LogprobEntry | None] | None = None,
                             queue_time_s: float | None = None) -> RequestOutput | None:
        """Decode worker: the prompt's KV is in the reserved blocks and the prefill
        worker sampled `first_token` (with its logprobs entry when the request
        asks for logprobs, the prompt's logprobs when it asks for those, and the
        time it queued there). The request decodes from the next step. Returns
        the output carrying the first token (final if it already stops)."""
        req = self._awaiting_kv(request_id)
        if req.prompt_logprobs is not None:
            if prompt_logprobs is None or len(prompt_logprobs) != req.num_prompt_tokens:
                raise ValueError(f"prompt_logprobs: the prefill worker sent {len(prompt_logprobs or [])} entries "
                                 f"for {req.num_prompt_tokens} prompt tokens")
            req.prompt_logprobs = list(prompt_logprobs)
        req.queue_time_s = queue_time_s
        self.scheduler.complete_remote(req)
        self.stats.generation_tokens += 1
        reason = append_token(req, first_token, dict(first_logprobs or {}) if req.logprobs is not None else None,
                              self.max_model_len)
        return self._emit(req, reason)

    def prefill_locally(self, request_id: str) -> None:
        """Decode worker: the KV transfer failed; recompute the prompt here instead."""
        self.scheduler.prefill_locally(self._awaiting_kv(request_id))

    def release(self, request_id: str) -> None:
        """Prefill worker: free the blocks of a finished `hold_kv` request."""
        self.scheduler.release(request_id)

    def prefill_progress(self, request_id: str) -> tuple[int, bool] | None:
        """(prompt tokens whose KV is computed, finished) of a live or held request."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        computed = req.num_computed_tokens
        if self._in_flight is not None and (before := self._in_flight.computed_before.get(request_id)) is not None:
            computed = min(computed, before)  # the step in flight has not written its KV yet
        return min(computed, req.num_prompt_tokens), req.finished

    def lifecycle_of(self, request_id: str) -> Lifecycle | None:
        """The lifecycle of a live or held request (None: not here)."""
        req = self.scheduler.requests.get(request_id)
        return req.life if req is not None else None

    def blocks_of(self, request_id: str) -> list[int]:
        """The KV blocks a live or held request holds, in token order."""
        return self.kv.blocks_of(request_id)

    # -- reading --------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """Load and counters now (engine thread): the one way others read the engine."""
        sched, pool, st = self.scheduler, self.kv.pool, self.stats
        return EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting) + len(sched.awaiting_kv),
            queued_prefill_tokens=sched.queued_prefill_tokens(), free_blocks=pool.num_free,
            total_blocks=pool.num_blocks, prompt_tokens=sched.num_queried_prompt_tokens,
            prompt_tokens_cached=sched.num_cached_prompt_tokens, prompt_tokens_computed=st.prompt_tokens_computed,
            generation_tokens=st.generation_tokens, preemptions=st.preemptions, spec_drafts=st.spec_drafts,
            spec_draft_tokens=st.spec_draft_tokens, spec_accepted_tokens=st.spec_accepted_tokens,
            spec_accepted_per_position=tuple(st.spec_accepted_per_position),
            grammar_mask_s=self.runner.grammar_mask_s, **self._grammar_counts())

    def _grammar_counts(self) -> dict[str, Any]:
        g = self._grammars.stats if self._grammars is not None else GrammarStats()
        return {"constrained_requests": g.constrained_requests, "grammar_compiles": g.compiles,
                "grammar_compile_s": g.compile_s, "grammar_cache_hits": g.cache_hits}

    def take_kv_events(self) -> list[KVEvent]:
        """Blocks that entered or left the prefix cache since the last call (`record_kv_events`)."""
        return self.kv.pool.take_events()

    # -- the step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> append what was sampled -> outputs (aborted requests' first).

        With async scheduling a step returns the outputs of the step before it: it launches
        the next one first (workers/in_flight.py), and `has_unfinished_requests` holds while
        one is in flight. Runs on this engine's share of threads (`torch_threads`), the
        caller's count restored after (an engine thread has the share already: nothing to set)."""
        caller = torch.get_num_threads()
        if caller == self.torch_threads:
            return self._step()
        torch.set_num_threads(self.torch_threads)
        try:
            return self._step()
        finally:
            torch.set_num_threads(caller)

    def _step(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if self._in_flight is not None and not self._in_flight.chainable:
            outputs += self._land()  # the next step needs its tokens on the host
        if self._grammars is not None:
            self._check_grammars()
        sched = self._schedule()
        if not sched.scheduled:
            if self._in_flight is not None:
                outputs += self._land()
            else:
                self._wait_for_grammars()
            self.cpu_idle()
            outputs += self._fault_outputs  # requests whose grammar failed to compile
            self._fault_outputs = []
            return outputs
        with self.cpu_turn:  # the model's work (and the draft's, in _after_step), on the cores it may use
            start = time.perf_counter()
            before = self._in_flight
            result = self._execute(sched, before.feed if before is not None else None, outputs)
            if self._in_flight is not None:  # (not when the step raised: `_execute` landed it then)
                self.overlapped_steps += 1
                outputs += self._land()  # while the device runs the step just launched
            self._in_flight = self._launched(sched, result, start)
            if not self.async_scheduling:
                outputs += self._land()
        outputs += self._fault_outputs
        self._fault_streak = self._fault_streak + 1 if self._fault_outputs and not sched.scheduled else 0
        self._fault_outputs = []
        return outputs

    def _check_grammars(self) -> None:
        """Build the matchers of waiting requests whose grammar just compiled (they can be
        scheduled from now on); fail alone those whose grammar did not compile."""
        for req in [r for r in self.scheduler.waiting if not r.schedulable]:
            assert req.grammar is not None
            try:
                req.grammar.ready(req.output_token_ids)
            except ValueError as e:
                self._fault(req, str(e))

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if a request waits for its grammar, wait a moment for it here
        rather than spin through empty steps."""
        pending = next((r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.schedulable),
                       None)
        if pending is not None:
            pending.wait(GRAMMAR_POLL_S)

    def _execute(self, sched: SchedulerOutput, feed: TokenFeed | None, landed: list[RequestOutput]) -> StepResult:
        """Run the step (on a GPU: queue it). If it raises, the rows that fail alone are
        their requests' faults (workers/row_faults.py): those are failed and dropped from
        `sched`, and the rest run. A fault no row explains, or one more step of nothing but
        faults than MAX_FAULT_STREAK allows, is the engine's: it raises. A step in flight
        (async scheduling) is landed first, its outputs added to `landed`."""
        try:
            return self.runner.execute(sched.scheduled, feed=feed)
        except TPGroupError:
            raise  # no row of a tensor-parallel step can be run again alone
        except Exception as first:
            if self._fault_streak >= row_faults.MAX_FAULT_STREAK:
                raise
            error = first
            if self._in_flight is not None:
                # Land the step in flight before judging rows, as the synchronous engine had: a
                # request its tokens end (a stop token) has a row here it never needed, and must
                # finish, not fail for that row; a request that fails keeps the token it sampled.
                landed += self._land()
                sched.scheduled = [s for s in sched.scheduled if not s.request.finished]
                if not sched.scheduled:
                    return StepResult([], SamplerOutput(torch.empty(0, dtype=torch.int64)))
                try:  # the row that raised may have been one of those
                    return self.runner.execute(sched.scheduled, feed=feed)
                except Exception as again:  # noqa: BLE001 - judged row by row below
                    error = again
            for s, e in row_faults.isolate(lambda rows: self.runner.execute(rows, feed=feed), sched.scheduled,
                                           error, self._engine_runs):
                self._fault(s.request, row_faults.describe(e))
            sched.scheduled = [s for s in sched.scheduled if not s.request.finished]
            if not sched.scheduled:
                return StepResult([], SamplerOutput(torch.empty(0, dtype=torch.int64)))
            return self.runner.execute(sched.scheduled, feed=feed)

    def _engine_runs(self) -> None:
        """Raise unless the engine can run a step of its own: one token of a request no client
        sent, in a block taken from the free ones and given back (it is never cached). Asked
        when every row of a failed step failed alone too: the rows' faults, or the engine's."""
        rid = "pdserve-engine-check"
        while rid in self.kv.req_blocks or rid in self.scheduler.requests:  # a client's may be named so
            rid += "+"
        probe = Request(rid, [0], _PROBE_PARAMS, max_tokens=1)
        if not self.kv.allocate_slots(probe, 1):
            raise row_faults.NoRoomToCheck("no free KV block to check the engine with")
        try:
            result = self.runner.execute([ScheduledRequest(probe, 1)])
            result.output.token_ids.tolist()  # on a device: waits for the step, so its error is raised here
        finally:
            self.kv.free(probe)

    def _launched(self, sched: SchedulerOutput, result: StepResult, start: float) -> InFlight:
        """Advance the step just queued (its rows of requests finished since it was scheduled
        are dropped) and keep it in flight until `_land`."""
        computed_before = ({s.request.request_id: s.request.num_computed_tokens for s in sched.scheduled}
                           if self.async_scheduling else None)
        work = self._advance(sched)
        for req in result.sampled:
            if not req.finished:
                req.num_pending += 1  # its token is read when the step lands
        running = self.scheduler.running
        # Drafts already made count too: the speculator drafted as the step before landed, for a
        # batch that rows failed since may have shrunk to a dormant size (`_execute`). The next step
        # verifies them, from a last token that must be on the host by then.
        drafting = self.spec is not None and (not self.spec.dormant(len(running))
                                              or any(r.spec_token_ids for r in running))
        return launch_record(sched, result, work, start, chains(result, drafting), computed_before)

    def _land(self) -> list[RequestOutput]:
        """The step in flight's tokens on the host: appended, checked, turned into outputs."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        outputs = self._postprocess(flight.landed())
        self._after_step(flight.sched, flight.work, flight.start, overlapped=flight.chainable)
        return outputs

    def _fault(self, req: Request, why: str, refused: bool = False) -> None:
        """Fail `req` alone: its blocks are freed now, and its final output carries `why`
        (its worker turns that into the request's error; it is not migrated). `refused`:
        the request's own input is at fault (a ValueError for the caller: a 400)."""
        log.warning("request %s failed in this engine's step: %s", req.request_id, why)
        self.stats.request_faults += 1
        self.scheduler.finish(req, FinishReason.ABORT)
        self.scheduler.release(req.request_id)
        out = request_output(req)
        out.error, out.error_refused = why, refused
        self._fault_outputs.append(out)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        return sched

    def _advance(self, sched: SchedulerOutput) -> StepStats:
        """Count the step's prompt and decode work (its duration is not known yet:
        0); advance every row but the verifying ones (they advance by what the
        target accepts)."""
        prefill_tokens = decode_seqs = 0
        for s in sched.scheduled:
            req = s.request
            if req.finished:  # by the step that landed after this one was scheduled: its row is dropped
                continue
            start = req.num_computed_tokens
            computed = max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            prefill_tokens += computed
            decode_seqs += computed == 0
            if not s.num_spec:
                self.scheduler.advance(s)
        self.stats.prompt_tokens_computed += prefill_tokens
        self.stats.steps += 1
        return StepStats(0.0, prefill_tokens, decode_seqs, sched.num_tokens)

    def _postprocess(self, result: StepResult) -> list[RequestOutput]:
        for scored in result.prompt_logprobs:  # before the samples: a finishing output carries them
            record_prompt_logprobs(scored)
        return self._append_samples(result.sampled, result.output) + self._append_verified(result.spec)

    def _after_step(self, sched: SchedulerOutput, work: StepStats, start: float, overlapped: bool = False) -> None:
        """Speculation learns the step's cost (not from a step the next overlapped: its time is
        not its own) and drafts for the next one; observers hear of it."""
        if self.spec is not None:
            if work.prefill_tokens == 0 and not overlapped:
                self.spec.cost.observe_step(len(sched.scheduled), work.scheduled_tokens, time.perf_counter() - start)
            self.spec.propose(list(self.scheduler.running))
        if self.step_observers:
            step = StepStats(time.perf_counter() - start, work.prefill_tokens, work.decode_seqs, work.scheduled_tokens)
            for observe in self.step_observers:
                observe(step)

    def _append_samples(self, reqs: list[Request], out: SamplerOutput) -> list[RequestOutput]:
        tokens = out.token_ids.tolist()
        entries = logprob_entries(out, tokens, [r.params.logprobs or 0 for r in reqs])
        outputs = []
        for req, token, entry in zip(reqs, tokens, entries):
            if req.finished:  # since its step was launched (aborted, or a token of the step before)
                continue
            req.num_pending -= 1
            self.stats.generation_tokens += 1
            if (reason := self._append_checked(req, token, entry)) is False:
                continue
            if (o := self._emit(req, reason)) is not None:
                outputs.append(o)
        return outputs

    def _append_checked(self, req: Request, token: int,
                        entry: LogprobEntry | None) -> FinishReason | None | Literal[False]:
        """`append_token`, or False once `req` is failed alone: its row had no valid token
        (NO_TOKEN: its logits were NaN or infinite), or appending raised."""
        if token == NO_TOKEN or not 0 <= token < self.runner.vocab_size:
            if req.grammar is not None and not req.grammar.allowed(self.runner.vocab_size).any():
                # Its grammar allows nothing from here (a spec that cannot go on): the client's spec, a 400.
                self._fault(req, f"{req.grammar.spec.field}: no output can match it past output token "
                                 f"{req.num_output_tokens}", refused=True)
            elif (field := self._restrictions_left_nothing(req)) is not None:
                # The client's restrictions contradict each other here: a 400, not a server fault.
                self._fault(req, f"{field}: every token it allows at output token {req.num_output_tokens} is "
                                 f"banned (by min_tokens' stop tokens, bad_words or the structured output)",
                            refused=True)
            else:
                self._fault(req, "its logits had no finite choice (NaN or infinite values)")
            return False
        try:
            return append_token(req, token, entry, self.max_model_len)
        except Exception as e:  # noqa: BLE001 - this request's fault: it fails alone
            self._fault(req, row_faults.describe(e))
            return False

    def _restrictions_left_nothing(self, req: Request) -> str | None:
        """The field whose tokens `req`'s other restrictions all banned this step, if so:
        allowed_token_ids, or its structured output (each of its tokens a stop token under
        min_tokens, a bad word's end, or outside allowed_token_ids); None otherwise."""
        allowed, grammar = req.params.allowed_token_ids, req.grammar
        if allowed is None and grammar is None:
            return None
        banned = set(banned_by_words(req.bad_words_token_ids, req.output_token_ids))
        if req.num_output_tokens < req.params.min_tokens:
            banned |= req.stop_token_ids
        if grammar is None:
            assert allowed is not None
            return "allowed_token_ids" if all(t in banned for t in allowed) else None
        mask = grammar.allowed(self.runner.vocab_size)
        if allowed is not None:
            keep = np.zeros_like(mask)
            keep[[t for t in allowed if 0 <= t < mask.size]] = True
            mask &= keep
        mask[[t for t in banned if 0 <= t < mask.size]] = False
        if mask.any():
            return None
        return "allowed_token_ids" if allowed is not None else grammar.spec.field

    def _append_verified(self, results: list[SpecResult]) -> list[RequestOutput]:
        """Append what verification emitted (up to a stop), and count as computed
        only the KV of the accepted drafts: the rest is rolled back (its slots are
        rewritten next step, its blocks never cached)."""
        if not results:
            return []
        spec = self.spec
        assert spec is not None, "verification without a speculator"
        outputs = []
        for r in results:
            s, req = r.scheduled, r.scheduled.request
            req.spec_token_ids, req.spec_draft_probs = [], None
            if req.finished:  # since its step was launched (aborted): its blocks are freed, its final sent
                continue
            accepted = len(r.tokens) - 1
            spec.verified(req, s.num_spec, accepted, self.stats)
            reason: FinishReason | None | Literal[False] = None
            for i, token in enumerate(r.tokens):
                self.stats.generation_tokens += 1
                reason = self._append_checked(req, token, r.logprobs[i] if r.logprobs is not None else None)
                if reason is not None:
                    break
            if reason is False:
                continue
            if reason is None:
                self.scheduler.advance(s, accepted)
            if (o := self._emit(req, reason)) is not None:
                outputs.append(o)
        return outputs

    # -- one token, one output ----------------------------------------------------

    def _emit(self, req: Request, reason: FinishReason | None) -> RequestOutput | None:
        """After a step's tokens for `req`: the one place a request finishes. `reason`
        ends it (its blocks are freed, or held for a handoff) with its final output;
        otherwise its output, unless it only wants the final one."""
        self.scheduler.took_token(req, reason)
        if reason is not None:
            return request_output(req)
        if req.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        return request_output(req)

    # -- admission ------------------------------------------------------------------

    def _new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                     hold_kv: bool, life: Lifecycle | None, ends_in_engine: bool | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, token_ids, max_tokens = self._prepare(prompt, params)
        req = Request(request_id, token_ids, params, prompt=text, eos_token_ids=self._eos_token_ids,
                      max_tokens=max_tokens, device=self.device, hold_kv=hold_kv, life=life,
                      ends_in_engine=ends_in_engine)
        if params.detokenize:
            assert isinstance(params.stop, list)  # SamplingParams normalises it
            req.detok = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, token_ids, params.stop,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
        if params.bad_words:
            req.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer, self.runner.vocab_size)
        if (spec := params.constraint) is not None:
            req.grammar = self.grammar_compiler().state(spec)
        self.stats.prompt_tokens += len(token_ids)
        if self.spec is not None:
            req.spec_acceptance = self.spec.acceptance  # until its own drafts say otherwise
        return req

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:  # the tokenizer's TypeError, on a lone surrogate ("\ud800")
                raise ValueError("prompt: not valid Unicode (a lone surrogate)") from None
            # Checked as given ids are: a tokenizer may know more tokens than the model has
            # embeddings (another model's `tokenizer`, tokens added without resizing), and an id
            # past the table failed the step (compiled, it aborted the process).
            text, token_ids = prompt, check_token_ids(self.tokenizer.encode(prompt), self.model_config.vocab_size)
        else:
            text, token_ids = None, check_token_ids(prompt, self.model_config.vocab_size)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        check_request(params, self.model_config.vocab_size, self.config.max_logprobs)
        return text, token_ids, max_new_tokens(len(token_ids), params.max_tokens, self.max_model_len)

    def _awaiting_kv(self, request_id: str) -> Request:
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not waiting for KV")
        return req

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def too_slow(params: SamplingParams) -> str:
    """The error of a grammar that did not compile within GRAMMAR_COMPILE_TIMEOUT_S."""
    assert params.constraint is not None
    return f"{params.constraint.field}: did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s"
