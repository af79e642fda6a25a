"""The single-worker engine: `add_request`, `step`, `abort`.

A step is: schedule -> run the model on the scheduled tokens -> append the
sampled tokens -> stop checks -> outputs. Prefill and decode workers drive this
same loop; `pdserve.LLM` wraps it for offline use.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

from pdserve.kernels.attention import AttentionBackend
from pdserve.workers.config import EngineConfig
from pdserve.workers.detokenizer import IncrementalDetokenizer
from pdserve.workers.kv.cache import allocate_kv_caches, bytes_per_block, kv_budget_bytes
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.loader import load_model, resolve_dtype
from pdserve.workers.model_runner import ModelRunner, PromptLogprobs, SpecResult
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.request import Request, RequestStatus
from pdserve.workers.sampler import SamplerOutput, advance_generator
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.scheduler import Scheduler, SchedulerConfig
from pdserve.workers.spec.draft import DraftModelProposer
from pdserve.workers.spec.ngram import NgramProposer
from pdserve.workers.spec.planner import Speculator


@dataclass
class EngineStats:
    """Monotonic counters since the engine started."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputes included)
    prompt_tokens_cached: int = 0  # prompt tokens served from the prefix cache at first schedule
    generation_tokens: int = 0
    preemptions: int = 0
    # Speculative decoding: verification passes, drafted tokens in them, drafts
    # the target accepted, and accepted counts by draft position (index 0: first draft).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens emitted per verification pass (accepted drafts + the target's own)."""
        return (self.spec_accepted_tokens + self.spec_drafts) / self.spec_drafts if self.spec_drafts else 0.0


@dataclass(frozen=True)
class StepStats:
    """One engine step that ran the model, for step observers (worker metrics)."""

    duration_s: float
    prefill_tokens: int  # prompt tokens computed in this step
    decode_seqs: int  # sequences that decoded (or verified drafts) in this step
    scheduled_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.dtype = _resolve_model_dtype(config.dtype, self.model_config, self.device)
        self.max_model_len = _resolve_max_model_len(config.max_model_len, self.model_config)
        backend = AttentionBackend(config.attention_backend).resolve(self.device)
        torch.manual_seed(config.seed)
        self._log(f"loading {config.model} ({self.model_config.arch}, {self.dtype}, {self.device})")
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.model = load_model(config.model, self.model_config, self.dtype, self.device, backend,
                                self.max_model_len, progress=config.progress)
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_kv_blocks, config.block_size, self.dtype, self.device)
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 record_events=config.record_kv_events)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv)
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv, config.max_num_batched_tokens,
                                  config.max_num_seqs, self.max_model_len, self.device)
        self.stats = EngineStats()
        # Called on the engine thread after every step that ran the model; keep them cheap.
        self.step_observers: list[Callable[[StepStats], None]] = []
        self.spec: Speculator | None = None  # speculative decoding, when configured
        if config.speculative == "ngram":
            proposer = NgramProposer(config.spec_ngram_min, config.spec_ngram_max, config.num_speculative_tokens)
            self.spec = Speculator(config, proposer, self.max_model_len)
        elif config.speculative == "draft":
            self._log(f"loading draft model {config.draft_model}")
            proposer = DraftModelProposer(
                str(config.draft_model), self.model_config, self.dtype, self.device, backend, self.num_kv_blocks,
                config.block_size, self.max_model_len, config.max_num_batched_tokens, config.max_num_seqs,
                progress=config.progress)
            self.spec = Speculator(config, proposer, self.max_model_len)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, chars) already sent as deltas
        self._aborted_outputs: list[RequestOutput] = []
        self._held: dict[str, Request] = {}  # finished hold_kv requests whose blocks wait for release()
        self._log(f"KV cache: {self.num_kv_blocks} blocks of {config.block_size} tokens; max_model_len {self.max_model_len}")

    # -- public API ---------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    hold_kv: bool = False) -> None:
        """Queue a request. Raises ValueError (changing nothing) on bad input.

        `hold_kv` (prefill worker): when the request finishes, its blocks stay
        allocated until `release(request_id)`, so their KV can be sent.
        """
        self.scheduler.add(self._new_request(request_id, prompt, params, hold_kv))

    def add_remote_prefill_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
    ) -> tuple[list[int], int] | None:
        """Decode worker: reserve blocks for a prompt whose KV a prefill worker
        will write. Returns (block ids covering the prompt, tokens this worker
        already caches — those blocks need no transfer), or None when the pool
        cannot hold it now (nothing changed). Then `finish_remote_prefill` or `abort`."""
        req = self._new_request(request_id, prompt, params, hold_kv=False)
        plan = self.scheduler.reserve_remote(req)
        if plan is None:
            self._detok.pop(request_id, None)
            self.stats.prompt_tokens -= req.num_prompt_tokens
        return plan

    def finish_remote_prefill(self, request_id: str, first_token: int,
                              first_logprobs: dict[int, float] | None = None,
                              prompt_logprobs: list[dict[int, float] | None] | None = None) -> RequestOutput | None:
        """Decode worker: the prompt's KV is in the reserved blocks and the prefill
        worker sampled `first_token` (with `first_logprobs`, its logprobs entry,
        when the request asks for logprobs, and the prompt's logprobs when it asks
        for those). The request decodes from the next step. Returns the output
        carrying the first token (final if it already stops)."""
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not waiting for KV")
        if req.prompt_logprobs is not None:
            if prompt_logprobs is None or len(prompt_logprobs) != req.num_prompt_tokens:
                raise ValueError(f"prompt_logprobs: the prefill worker sent {len(prompt_logprobs or [])} entries "
                                 f"for {req.num_prompt_tokens} prompt tokens")
            req.prompt_logprobs = list(prompt_logprobs)
        self.scheduler.complete_remote(req)
        if req.logprobs is not None:
            # Keep one entry per output token, or every later entry is misplaced.
            entry = dict(first_logprobs or {})
            req.logprobs.append(entry)
            req.cumulative_logprob += entry.get(first_token, 0.0)
        if req.generator is not None and req.params.temperature:
            # The prefill worker drew this token from the same seeded stream:
            # consume that draw so later tokens match a colocated run.
            advance_generator(req.generator, self.model_config.vocab_size, self.device)
        outs = self._process_samples([req], SamplerOutput(torch.tensor([first_token])))
        return outs[0] if outs else None

    def prefill_locally(self, request_id: str) -> None:
        """Decode worker: the KV transfer failed; recompute the prompt here instead."""
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not waiting for KV")
        self.scheduler.prefill_locally(req)

    def release(self, request_id: str) -> None:
        """Prefill worker: free the blocks of a finished `hold_kv` request."""
        req = self._held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def progress(self, request_id: str) -> tuple[int, bool] | None:
        """(prompt tokens whose KV is computed, finished) of a live or held request."""
        req = self.scheduler.requests.get(request_id) or self._held.get(request_id)
        if req is None:
            return None
        return min(req.num_computed_tokens, req.num_prompt_tokens), req.status.finished

    def held_blocks(self, request_id: str) -> list[int]:
        return self.kv.blocks_of(request_id) if request_id in self._held else []

    def _new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None, hold_kv: bool) -> Request:
        params = params or SamplingParams()
        if request_id in self.scheduler.requests or request_id in self._held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text, token_ids, max_tokens = self._prepare(prompt, params)
        req = Request(request_id, token_ids, params, prompt=text, eos_token_ids=self._eos_ids(),
                      max_tokens=max_tokens, device=self.device, hold_kv=hold_kv)
        if params.detokenize or params.stop:
            self._detok[request_id] = IncrementalDetokenizer(
                self.tokenizer.backend_tokenizer, token_ids, params.stop, params.include_stop_str_in_output,
                params.skip_special_tokens)
        self.stats.prompt_tokens += len(token_ids)
        if self.spec is not None:
            req.spec_acceptance = self.spec.acceptance  # until its own drafts say otherwise
        return req

    def validate(self, prompt: str | list[int], params: SamplingParams) -> None:
        """Raise ValueError if add_request would reject this prompt and params."""
        self._prepare(prompt, params)

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], int]:
        text, token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab})")
        return text, token_ids, self._check_lengths(token_ids, params)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now; their blocks are freed before this returns. Unknown ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.release(rid)  # a finished prefill whose KV was still to be sent
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._aborted_outputs.append(self._finish_output(req))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        self.stats.prompt_tokens_cached = self.scheduler.num_cached_prompt_tokens
        if not sched.scheduled:
            return outputs
        t0 = time.perf_counter()
        result = self.runner.execute(sched.scheduled)
        prefill_tokens = decode_seqs = 0
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            computed = max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            prefill_tokens += computed
            decode_seqs += computed == 0
            if not s.num_spec:  # verifying requests advance by what the target accepted
                self.scheduler.advance(s)
        self.stats.prompt_tokens_computed += prefill_tokens
        self.stats.steps += 1
        for scored in result.prompt_logprobs:  # before the samples: a finishing output carries them
            _record_prompt_logprobs(scored)
        outputs.extend(self._process_samples(result.sampled, result.output))
        outputs.extend(self._process_spec(result.spec))
        scheduled_tokens = sum(s.num_tokens for s in sched.scheduled)
        if self.spec is not None:
            if prefill_tokens == 0:
                self.spec.cost.observe_step(len(sched.scheduled), scheduled_tokens, time.perf_counter() - t0)
            self.spec.propose(list(self.scheduler.running))
        if self.step_observers:
            step = StepStats(time.perf_counter() - t0, prefill_tokens, decode_seqs, scheduled_tokens)
            for observe in self.step_observers:
                observe(step)
        return outputs

    # -- internals ----------------------------------------------------------

    def _process_samples(self, reqs: list[Request], out: SamplerOutput) -> list[RequestOutput]:
        tokens = out.token_ids.tolist()
        sampled_lp = out.sampled_logprob.tolist() if out.sampled_logprob is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        outputs = []
        self.stats.generation_tokens += len(tokens)
        for row, (req, token) in enumerate(zip(reqs, tokens)):
            req.append_token(token)
            if req.logprobs is not None and sampled_lp is not None:
                n = req.params.logprobs or 0
                entry = dict(zip(top_ids[row][:n], top_lp[row][:n])) if top_ids else {}
                entry[token] = sampled_lp[row]
                req.logprobs.append(entry)
                req.cumulative_logprob += sampled_lp[row]
            status = self._check_stop(req, token)
            if status is not None:
                self.scheduler.finish(req, status, keep_blocks=req.hold_kv)
                if req.hold_kv:
                    self._held[req.request_id] = req
                outputs.append(self._finish_output(req))
            elif req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(req))
        return outputs

    def _process_spec(self, results: list[SpecResult]) -> list[RequestOutput]:
        """Append what verification emitted (stopping at a stop condition), and
        count as computed only the KV of the accepted drafts: the rest is rolled
        back (its slots are rewritten next step, its blocks never cached)."""
        outputs = []
        for r in results:
            s, req = r.scheduled, r.scheduled.request
            req.spec_token_ids, req.spec_draft_probs = [], None
            accepted = len(r.tokens) - 1
            assert self.spec is not None, "verification without a speculator"
            self.spec.verified(req, s.num_spec, accepted, self.stats)
            status = None
            for i, token in enumerate(r.tokens):
                req.append_token(token)
                self.stats.generation_tokens += 1
                if req.logprobs is not None and r.logprobs is not None:
                    req.logprobs.append(r.logprobs[i])
                    req.cumulative_logprob += r.logprobs[i][token]
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if status is None:
                self.scheduler.advance(s, accepted)
                if req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    outputs.append(self._make_output(req))
            else:
                self.scheduler.finish(req, status, keep_blocks=req.hold_kv)
                if req.hold_kv:
                    self._held[req.request_id] = req
                outputs.append(self._finish_output(req))
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        detok = self._detok.get(req.request_id)
        may_stop = req.num_output_tokens >= req.params.min_tokens
        stop_str = detok.add(token, may_stop) if detok is not None else None
        if may_stop:
            if token in req.stop_token_ids:
                req.stop_reason = token if token in (req.params.stop_token_ids or ()) else None
                return RequestStatus.FINISHED_STOPPED
            if stop_str is not None:
                req.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, req: Request) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        text = detok.text if detok is not None else ""
        token_ids = req.output_token_ids
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if req.params.output_kind is RequestOutputKind.DELTA:
            sent_tokens, sent_chars = self._sent.get(req.request_id, (0, 0))
            if sent_tokens or req.request_id in self._sent:
                prompt_logprobs = None  # sent with the first delta
            self._sent[req.request_id] = (len(token_ids), len(text))
            token_ids, text = token_ids[sent_tokens:], text[sent_chars:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=logprobs, finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
        )
        metrics = {}
        if req.first_scheduled_time is not None:  # time from arrival here to first schedule
            metrics["queue_time_s"] = req.first_scheduled_time - req.arrival_time
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             finished=req.status.finished, num_cached_tokens=max(req.num_cached_tokens, 0),
                             metrics=metrics, prompt_logprobs=prompt_logprobs)

    def _finish_output(self, req: Request) -> RequestOutput:
        out = self._make_output(req)
        self._detok.pop(req.request_id, None)
        self._sent.pop(req.request_id, None)
        return out

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        return None, token_ids

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len {self.max_model_len}")
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len {self.max_model_len}")
        return params.max_tokens or room

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _num_kv_blocks(self) -> int:
        per_block = bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.config.num_kv_blocks is not None:
            n = self.config.num_kv_blocks
        else:
            reserve = self.config.max_num_batched_tokens * self.model_config.intermediate_size * 16
            n = kv_budget_bytes(self.device, self.config.kv_cache_memory, self.config.gpu_memory_utilization, reserve) // per_block
        need = -(-self.max_model_len // self.config.block_size)
        if n < need:
            raise ValueError(f"num_kv_blocks: {n} blocks of {self.config.block_size} tokens cannot hold one "
                             f"max_model_len ({self.max_model_len}) sequence; raise the KV budget or lower max_model_len")
        return n

    def _log(self, msg: str) -> None:
        if self.config.progress:
            print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def _record_prompt_logprobs(scored: PromptLogprobs) -> None:
    entries = scored.request.prompt_logprobs
    assert entries is not None and len(entries) == scored.first, "prompt tokens scored out of order"
    for i, lp in enumerate(scored.token_logprobs):
        entry = dict(zip(scored.top_ids[i], scored.top_logprobs[i]))
        entry[scored.request.prompt_token_ids[scored.first + i]] = lp
        entries.append(entry)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_model_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return resolve_dtype(name)
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and the tiny model is small
    return resolve_dtype(cfg.torch_dtype) if cfg.torch_dtype in ("float16", "bfloat16") else torch.bfloat16


def _resolve_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        # Attention here is full-context; past the window it would differ from the model's.
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's limit of {limit} positions")
    return requested
