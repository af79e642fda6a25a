"""Turns a scheduled step into tensors, runs the model, samples.

The batch is packed decode-first: sequences with one new token, then
multi-token (prefill) chunks, which is the order AttentionMetadata promises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.bad_words import banned_by_words
from pdserve.workers.buffers import InputBuffers, small_tensor
from pdserve.workers.grammar import GrammarState, apply_bitmask, fill_bitmask, verify_bitmask
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.model.compiled import Forward
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.request import Request
from pdserve.workers.sampler import Penalties, SamplerOutput, SamplingBatch, sample, sample_with_probs, seeded_at
from pdserve.workers.scheduler import ScheduledRequest
from pdserve.workers.spec.rejection import pad_drafts, unflatten_logits, verify
from pdserve.workers.tp_group import StepInputs, TPGroup, TPGroupError, host_block_tables

if TYPE_CHECKING:
    from pdserve.workers.cuda_graphs import Bucket, DecodeGraphs
    from pdserve.workers.in_flight import TokenFeed

SCORE_ROWS = 256  # prompt positions whose logits are computed at once (prompt_logprobs)
# A step's grammar work: the sampled rows' bitmask and the verifying rows' (None: no grammar
# there), and the greedy sampled rows whose grammar checks the pick instead (row, grammar).
Masks = tuple[torch.Tensor | None, torch.Tensor | None, list[tuple[int, GrammarState]]]


@dataclass
class SpecResult:
    """A request that verified drafts this step."""

    scheduled: ScheduledRequest
    tokens: list[int]  # emitted: the accepted drafts, then the target's own next token
    # When the request asks for logprobs: per emitted token, the raw top-N and its own.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class PromptLogprobs:
    """Prompt tokens scored this step for a request that asked for prompt_logprobs."""

    request: Request
    first: int  # index (in the prompt) of the first token scored
    token_logprobs: list[float]  # each scored prompt token's log-prob given the tokens before it
    top_ids: list[list[int]]  # [tokens][N]
    top_logprobs: list[list[float]]


@dataclass
class HostStep:
    """A step's shape, as `_fill` wrote its inputs into the host buffers."""

    num_tokens: int
    num_seqs: int
    num_decode: int  # sequences [0, num_decode) have one new token and verify nothing
    logit_rows: int  # sampled rows, then k+1 per verifying sequence
    sampled: list[Request]  # requests that sample a token, in row order
    max_rows: int  # new tokens of the longest sequence


@dataclass
class StepResult:
    sampled: list[Request]  # requests that got a token this step, in row order
    output: SamplerOutput
    spec: list[SpecResult] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # execute(want_probs=True): [sampled, V], the distribution each token was drawn from
    probs: torch.Tensor | None = None


# How long a failed tensor-parallel step looks for a rank's exit before it says why it failed
# (workers/tp_group.py `gone`): the failure path only, where the group is broken anyway.
GONE_SETTLE_S = 1.0


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv: KVCacheManager,
        max_num_tokens: int, max_num_seqs: int, max_model_len: int, device: torch.device,
    ) -> None:
        self.model = model
        # What runs a step's forward: the model itself, or its compiled graph (set by the engine).
        self.forward: Forward = model
        self.kv_caches = kv_caches
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        max_blocks = -(-max_model_len // self.block_size)
        self.buf = InputBuffers(max_num_tokens, max_num_seqs, max_blocks, device)
        # Decode steps replayed from CUDA graphs (workers/cuda_graphs.py); None: every step eager.
        self.graphs: DecodeGraphs | None = None
        self.grammar_mask_s = 0.0  # seconds filling grammars' token bitmasks (and checking picks)
        # Greedy constrained rows: the grammar checks the pick rather than masking ahead
        # (`_fill_masks`); on a GPU the masks are filled while the forward pass runs instead.
        self.check_picks = device.type == "cpu"
        # This step's pending input ids: (token positions, rows of the feed, the feed's tokens).
        self._feed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # A tensor-parallel engine's other ranks (workers/tp_group.py), set by the engine: each
        # step's inputs go to them before its forward.
        self.tp_group: TPGroup | None = None
        # Whether the step under way made its last collective (then a fault leaves the ranks in step).
        self._tp_step_done = False

    def execute(self, scheduled: list[ScheduledRequest], want_probs: bool = False,
                feed: TokenFeed | None = None) -> StepResult:
        """Run one step (`_run_step`). With tensor-parallel ranks, a step that raises breaks the
        group (TPGroupError, now and at every later step): the other ranks may be waiting in a
        collective this rank never reached, so no row of it can be retried alone."""
        group = self.tp_group
        if group is None:
            return self._run_step(scheduled, want_probs, feed)
        if group.broken is not None:
            raise TPGroupError(f"the tensor-parallel group is broken: {group.broken}")
        self._tp_step_done = False
        try:
            return self._run_step(scheduled, want_probs, feed)
        except BaseException as e:
            if self._tp_step_done and isinstance(e, Exception):
                # Raised after this rank's last collective of the step (sampling a row): every rank
                # finished the step and the followers wait for the next, so the group is in step and
                # the row's fault is the row's (the engine fails it alone, as with one rank).
                raise
            group.mark_broken(e)
            gone = group.gone(settle_s=GONE_SETTLE_S)
            why = f"rank(s) {gone} are gone ({type(e).__name__}: {e})" if gone else f"{type(e).__name__}: {e}"
            raise TPGroupError(f"a tensor-parallel step failed: {why}") from e

    @torch.inference_mode()
    def _run_step(self, scheduled: list[ScheduledRequest], want_probs: bool = False,
                  feed: TokenFeed | None = None) -> StepResult:
        """Run one step. `want_probs`: also return the normalised distribution each sampled
        row was drawn from (a draft model's proposals need it for verification). `feed`: the
        tokens of the step in flight, the input of each request whose last token is pending
        (async scheduling, workers/in_flight.py)."""
        # Stable partition: decode rows first, as the attention metadata requires.
        ordered = [s for s in scheduled if s.num_tokens == 1] + [s for s in scheduled if s.num_tokens > 1]
        self.buf.begin_step()  # last step's copies have read the host buffers: they may be rewritten
        try:
            step = self._fill(ordered, feed)
            prompt_rows = self._prompt_logprob_rows(ordered, step.logit_rows)
            total_rows = step.logit_rows + sum(n for _, _, n in prompt_rows)
            idx = self.buf.logits_indices.to_device(total_rows)
            bucket = self.graphs.select(step) if self.graphs is not None else None
            if self.tp_group is not None:  # the other ranks run this step's forward and logits with us
                self._send_step(step, total_rows, [n for _, _, n in prompt_rows], bucket)
            hidden = self.forward_step(step, bucket)  # fences the copies (end_step) before it queues the model
        except BaseException:
            self.buf.end_step()
            raise
        sampled = step.sampled
        # On a GPU the forward pass is only queued by now: the masks are filled while it runs.
        masks = self._fill_masks(sampled, [s for s in ordered if s.num_spec], not want_probs)
        result = StepResult(sampled, SamplerOutput(torch.empty(0, dtype=torch.int64)))
        if prompt_rows:  # scored in slices: [rows, vocab] logits of a long chunk are large
            result.prompt_logprobs = self._score_prompts(prompt_rows, hidden, idx[step.logit_rows:])
        if step.logit_rows:
            logits = self.model.compute_logits(hidden[idx[: step.logit_rows]])
            self._tp_step_done = True  # the step's last collective (the logits' gather): the rest is this rank's
            # Rows: one per plain sampled request, then k+1 per verifying one.
            plain_mask, verify_mask, check_first = masks
            if sampled and want_probs:
                tokens, result.probs = sample_with_probs(logits[: len(sampled)],
                                                         self._sampling_batch(sampled, plain_mask))
                result.output = SamplerOutput(tokens)
            elif sampled:
                batch = self._sampling_batch(sampled, plain_mask)
                batch.check_first = check_first or None
                result.output = sample(logits[: len(sampled)], batch)
                self.grammar_mask_s += batch.check_s
            result.spec = self._verify([s for s in ordered if s.num_spec], logits[len(sampled):], verify_mask)
        return result

    def _fill_masks(self, sampled: list[Request], verifying: list[ScheduledRequest], may_check: bool) -> Masks:
        """The step's grammar bitmasks (structured outputs), for the sampled rows and the
        verifying ones (None where no row has a grammar). Called once the forward pass is
        queued: on a GPU it runs meanwhile. On a CPU the pass is done by then and nothing
        hides the masks' cost (a thread filling them beside the pass lost more to the OpenMP
        threads it preempted than it saved), so there a greedy row (`may_check`) is not masked
        ahead: its grammar checks the model's pick, and masks only a row whose pick it refuses
        (the same token: workers/sampler.py `_check_picks`). Masking ahead cost the tiny model
        ~12% of its batch-16 step, ~190 us filling 16 rows and ~85 us applying them, mostly
        cache misses after the forward pass (bench/structured.py, 2 cores)."""
        if not any(r.grammar is not None for r in sampled) and not any(s.request.grammar is not None
                                                                       for s in verifying):
            return None, None, []
        start = time.perf_counter()
        check_first: list[tuple[int, GrammarState]] = []
        ahead = [r.grammar for r in sampled]
        if may_check and self.check_picks:
            check_first = [(i, g) for i, (r, g) in enumerate(zip(sampled, ahead))
                           if g is not None and not g.dormant and r.params.temperature == 0.0]
            for i, _ in check_first:
                ahead[i] = None
        masks = (fill_bitmask(ahead, self.vocab_size),
                 verify_bitmask([s.request.grammar for s in verifying],
                                [s.request.spec_token_ids[: s.num_spec] for s in verifying], self.vocab_size),
                 check_first)
        self.grammar_mask_s += time.perf_counter() - start
        return masks

    def _send_step(self, step: HostStep, total_rows: int, prompt_counts: list[int], bucket: Bucket | None) -> None:
        """The step's inputs, from the host buffers `_fill` wrote, to the other ranks, and the CUDA
        graph that runs it (`bucket`; None: eager), which they replay too. Their compute_logits calls
        follow `logit_calls`, as this rank's do (execute, `_score_prompts`)."""
        assert self.tp_group is not None and self._feed is None, "tensor parallelism runs synchronous steps"
        b, t, n = self.buf, step.num_tokens, step.num_seqs
        lens = b.seq_lens.np[:n]
        self.tp_group.send_step(StepInputs(
            b.input_ids.cpu[:t], b.positions.cpu[:t], b.slot_mapping.cpu[:t],
            host_block_tables(b.block_tables.np, lens, self.block_size), b.seq_lens.cpu[:n],
            b.query_start_loc.cpu[: n + 1], step.num_decode, b.logits_indices.cpu[:total_rows], step.logit_rows,
            prompt_counts, (bucket.seqs, bucket.rows) if bucket is not None else None))

    def forward_step(self, step: HostStep, bucket: Bucket | None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step whose inputs are in the host buffers
        (`_fill` wrote them; a follower rank, workers/tp_follower.py): replayed from the CUDA graph
        `bucket` (`graphs.select`), else (None) run eagerly."""
        if bucket is not None:
            assert self.graphs is not None
            return self.graphs.replay(bucket, step)
        b = self.buf
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping.to_device(step.num_tokens),
            block_tables=b.block_tables.to_device(step.num_seqs),
            seq_lens=b.seq_lens.to_device(step.num_seqs),
            query_start_loc=b.query_start_loc.to_device(step.num_seqs + 1),
            num_decode_seqs=step.num_decode,
            seq_lens_np=b.seq_lens.np[: step.num_seqs],
            query_start_loc_np=b.query_start_loc.np[: step.num_seqs + 1],
            block_size=self.block_size,
        )
        input_ids, positions = b.input_ids.to_device(step.num_tokens), b.positions.to_device(step.num_tokens)
        self.feed_inputs(input_ids)
        # The fence goes right after the step's last copy, not after the model: the next step then
        # waits only for these copies, and its host work overlaps this step's GPU work.
        b.end_step()
        return self.forward(input_ids, positions, meta, self.kv_caches)

    def feed_inputs(self, input_ids: torch.Tensor) -> None:
        """After the step's input ids reached the device: the ids of pending tokens, copied
        there from the tokens the step in flight sampled (no host round trip). A row that had
        no valid token (NO_TOKEN) feeds token 0: its request fails when that step lands, and
        this row's output is dropped; an id out of range would fault the whole step."""
        if self._feed is None:
            return
        dst, src, tokens = self._feed
        self._feed = None
        input_ids.index_copy_(0, dst, tokens.index_select(0, src).clamp(min=0))

    def _prompt_logprob_rows(self, ordered: list[ScheduledRequest], row0: int) -> list[tuple[Request, int, int]]:
        """Queue, after the sampling rows, a logits row for each scheduled position that
        predicts a prompt token not scored yet (a recomputed chunk is not scored twice).
        Returns (request, first prompt token scored, count)."""
        out: list[tuple[Request, int, int]] = []
        idx = self.buf.logits_indices.np
        t = row = 0
        for s in ordered:
            req, n = s.request, s.num_tokens
            if req.prompt_logprobs is not None and not s.num_spec:
                start = req.num_computed_tokens
                # Position p predicts token p + 1: score tokens [first, last).
                first = max(start + 1, len(req.prompt_logprobs))
                last = min(start + n + 1, req.num_prompt_tokens)
                if last > first:
                    count = last - first
                    idx[row0 + row : row0 + row + count] = np.arange(t + first - 1 - start, t + last - 1 - start)
                    out.append((req, first, count))
                    row += count
            t += n
        return out

    def _score_prompts(self, rows: list[tuple[Request, int, int]], hidden: torch.Tensor,
                       idx: torch.Tensor) -> list[PromptLogprobs]:
        """Log-probs of the queued prompt tokens; `idx` holds their hidden-state rows.
        At most SCORE_ROWS rows of logits at a time (a 128k vocabulary makes
        [rows, vocab] float32 half a GiB per 1,024 rows)."""
        out, at = [], 0
        for req, first, count in rows:
            n = req.params.prompt_logprobs or 0
            own: list[float] = []
            top_ids: list[list[int]] = []
            top_lp: list[list[float]] = []
            for lo in range(0, count, SCORE_ROWS):
                hi = min(count, lo + SCORE_ROWS)
                lp = self.model.compute_logits(hidden[idx[at + lo : at + hi]]).float().log_softmax(dim=-1)
                targets = torch.tensor(req.prompt_token_ids[first + lo : first + hi], device=lp.device)
                own += lp.gather(1, targets[:, None])[:, 0].tolist()
                if n:
                    values, ids = lp.topk(n, dim=-1)
                    top_lp += values.tolist()
                    top_ids += ids.tolist()
                else:
                    top_lp += [[] for _ in range(hi - lo)]
                    top_ids += [[] for _ in range(hi - lo)]
            out.append(PromptLogprobs(req, first, own, top_ids, top_lp))
            at += count
        return out

    def _verify(self, verifying: list[ScheduledRequest], logits: torch.Tensor,
                mask: torch.Tensor | None = None) -> list[SpecResult]:
        """Exact verification (workers/spec/rejection.py): greedy rows keep drafts
        while they equal the target's argmax; sampled rows accept with
        probability min(1, p/q) (n-gram drafts: q one-hot) and resample from
        norm(max(0, p - q)) at the first rejection."""
        if not verifying:
            return []
        num_drafts = [s.num_spec for s in verifying]
        drafts, _ = pad_drafts([s.request.spec_token_ids[: s.num_spec] for s in verifying], logits.device)
        batch = self._sampling_batch([s.request for s in verifying], None)
        # Raw log-probs (before any processing, as the sampler reports them), read
        # before verify() touches the logits.
        raw = logits.log_softmax(dim=-1) if any(s.request.logprobs is not None for s in verifying) else None
        # Each position of a constrained row is masked by its grammar advanced along the drafts
        # before it: a draft the grammar refuses there has probability 0 and is rejected.
        if mask is not None:
            apply_bitmask(logits, mask)
        out = verify(unflatten_logits(logits, num_drafts), drafts, num_drafts, batch,
                     _draft_probs(verifying, drafts, logits.shape[-1]))
        results, start = [], 0
        for s, tokens in zip(verifying, out.token_ids):
            lp = None
            if raw is not None and s.request.logprobs is not None:
                lp = _entries(raw[start : start + len(tokens)], tokens, s.request.params.logprobs or 0)
            results.append(SpecResult(s, tokens, lp))
            start += s.num_spec + 1
        return results

    def _fill(self, ordered: list[ScheduledRequest], feed: TokenFeed | None = None) -> HostStep:
        """Write the step's inputs into the host buffers (nothing is copied yet); the ids of
        pending tokens are left for `feed_inputs` to copy from `feed` on the device."""
        b = self.buf
        fed_at: list[int] = []  # token positions whose ids come from `feed`
        fed_from: list[int] = []  # ... from these rows of it
        ids, pos, slots, tables = b.input_ids.np, b.positions.np, b.slot_mapping.np, b.block_tables.np
        seq_lens, qsl, logit_idx = b.seq_lens.np, b.query_start_loc.np, b.logits_indices.np
        bs = self.block_size
        t = 0
        num_decode = 0
        sampled: list[Request] = []
        qsl[0] = 0
        for i, s in enumerate(ordered):
            req, n = s.request, s.num_tokens
            start = req.num_computed_tokens
            blocks = self.kv.blocks_of(req.request_id)
            tables[i, : len(blocks)] = blocks
            if s.num_spec:  # verify: the last known token and the drafts, causal among themselves
                p = np.arange(start, start + n)
                ids[t : t + n] = req.all_token_ids[start:] + req.spec_token_ids[: s.num_spec]
                pos[t : t + n] = p
                slots[t : t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            elif n == 1:
                num_decode += 1
                if req.num_pending:
                    assert feed is not None, f"request {req.request_id}: its last token is in flight, no feed"
                    ids[t] = 0
                    fed_at.append(t)
                    fed_from.append(feed.rows[id(req)])
                else:
                    ids[t] = req.all_token_ids[start]
                pos[t] = start
                slots[t] = blocks[start // bs] * bs + start % bs
            else:
                p = np.arange(start, start + n)
                ids[t : t + n] = req.all_token_ids[start : start + n]
                pos[t : t + n] = p
                slots[t : t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            t += n
            seq_lens[i] = start + n
            qsl[i + 1] = t
            if s.samples and not s.num_spec:
                logit_idx[len(sampled)] = t - 1
                sampled.append(req)
        # Verifying requests' rows go after the plain ones: every position scores a draft.
        rows = len(sampled)
        end = 0
        for s in ordered:
            end += s.num_tokens
            if s.num_spec:
                logit_idx[rows : rows + s.num_tokens] = np.arange(end - s.num_tokens, end)
                rows += s.num_tokens
        max_rows = max((s.num_tokens for s in ordered), default=0)
        self._feed = None
        if fed_at:
            assert feed is not None
            self._feed = (small_tensor(fed_at, torch.int64, self.device),
                          small_tensor(fed_from, torch.int64, self.device), feed.tokens)
        return HostStep(num_tokens=t, num_seqs=len(ordered), num_decode=num_decode, logit_rows=rows,
                        sampled=sampled, max_rows=max_rows)

    def _sampling_batch(self, reqs: list[Request], token_bitmask: torch.Tensor | None) -> SamplingBatch:
        params = [r.params for r in reqs]
        temps = [p.temperature for p in params]
        # small_tensor, not torch.tensor(device=...): no stream sync before the sampled tokens' read-back.
        batch = SamplingBatch(temperature=small_tensor(temps, torch.float32, self.device), all_greedy=not any(temps),
                              any_greedy=not all(temps))
        if not batch.all_greedy:
            if any(p.top_k for p in params):
                top_k = [p.top_k or self.vocab_size for p in params]
                batch.top_k, batch.top_k_max = small_tensor(top_k, torch.int64, self.device), max(top_k)
            if any(p.top_p < 1.0 for p in params):
                batch.top_p = small_tensor([p.top_p for p in params], torch.float32, self.device)
            if any(p.min_p > 0.0 for p in params):
                batch.min_p = small_tensor([p.min_p for p in params], torch.float32, self.device)
            # A pending token (async scheduling) is an output before this row's.
            batch.generators = {i: seeded_at(r.generator, r.params.seed, r.num_output_tokens + r.num_pending)
                                for i, r in enumerate(reqs) if r.generator is not None and r.params.temperature}
        # min_tokens bans the stop tokens, but not where the request's grammar allows nothing else:
        # the grammar's end wins (it ends the request), as a row with nothing left would fail.
        banned = [(i, sorted(r.stop_token_ids)) for i, r in enumerate(reqs)
                  if r.stop_token_ids and r.num_output_tokens + r.num_pending < r.params.min_tokens
                  and (r.grammar is None or not r.grammar.allows_only(r.stop_token_ids, self.vocab_size))]
        # A bad word's last token where the output ends with the rest of it. Such a request has
        # no token pending (workers/in_flight.py `chains`) and no drafts: its output is all here.
        banned += [(i, ids) for i, r in enumerate(reqs) if r.bad_words_token_ids
                   and (ids := banned_by_words(r.bad_words_token_ids, r.output_token_ids))]
        batch.banned = banned or None
        allowed = [(i, small_tensor(r.params.allowed_token_ids, torch.int64, self.device))
                   for i, r in enumerate(reqs) if r.params.allowed_token_ids is not None]
        batch.allowed = allowed or None
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            batch.logit_bias = [
                (i, small_tensor(list(b), torch.int64, self.device),
                 small_tensor(list(b.values()), torch.float32, self.device))
                for i, b in biased]
        if any(p.has_penalties for p in params):
            batch.penalties = Penalties.build(
                [(r.prompt_token_ids, r.output_token_ids, r.params.presence_penalty, r.params.frequency_penalty,
                  r.params.repetition_penalty) for r in reqs], self.vocab_size, self.device)
        batch.token_bitmask = token_bitmask  # (the verify path masks its rows itself)
        batch.max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
        return batch


def _entries(logprobs: torch.Tensor, tokens: list[int], top_n: int) -> list[dict[int, float]]:
    """[T, V] log-probs of T positions -> per position {top-N ids: log-prob} plus the emitted token's."""
    own = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    if top_n:
        top_lp, top_ids = logprobs.topk(top_n, dim=-1)
        entries = [dict(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        entries = [{} for _ in tokens]
    for entry, tok, lp in zip(entries, tokens, own):
        entry[tok] = lp
    return entries


def _draft_probs(verifying: list[ScheduledRequest], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """[B, K, V]: the distribution each draft was sampled from. Sampled draft-model drafts
    bring theirs; deterministic ones (n-gram, argmax) are one-hot. None when all are."""
    if all(s.request.spec_draft_probs is None for s in verifying):
        return None
    probs = torch.zeros(drafts.shape[0], drafts.shape[1], vocab, dtype=torch.float32, device=drafts.device)
    probs.scatter_(2, drafts[..., None], 1.0)
    for row, s in enumerate(verifying):
        sampled_from = s.request.spec_draft_probs
        if sampled_from is not None:
            probs[row, : s.num_spec] = sampled_from[: s.num_spec]
    return probs
