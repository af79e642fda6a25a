"""Draft-model proposer: a small model with the target's tokenizer drafts k
tokens each step for every speculating request: its argmax for greedy
requests; for random ones, samples from its own distribution under the request's
temperature, top-k, top-p and min-p, handing that distribution (q) to verification.

The draft keeps its own paged KV (its own pool and block tables) and, per
request, a shadow sequence: the target's tokens plus the drafts of this step.
Each step it first catches up (computes KV for the tokens the target appended
since: the whole prompt the first time, then the accepted drafts and the
target's own token), which gives the first draft; then k - 1 one-token passes.
After verification only the KV of accepted tokens stays valid, so the shadow's
computed length is rewound to the accepted prefix (the rejected slots are
rewritten next time).

In disaggregated serving the decode worker prefills the draft itself during the
first catch-up (docs/speculative.md says why). Verification accepts a draft x
with probability min(1, p(x)/q(x)) and resamples from max(0, p - q) at the first
rejection, so the output distribution is the target's whatever q is; the closer q is to
p, the more is accepted (sampling from q accepts sum(min(p, q)) on average,
an argmax draft only p(argmax)). A seeded request's drafts draw from a
generator reseeded from its (salted) seed and the draft's position at every
step (sampler.seeded_at), so they depend on neither the batch nor a preemption
or a migration to another worker; which drafts are accepted still depends on
how many the engine chose to make, never the output's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.kv.cache import allocate_kv_caches
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model.loader import load_model
from pdserve.workers.model_runner import ModelRunner
from pdserve.workers.request import Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.scheduler import ScheduledRequest
from pdserve.workers.spec.proposer import Drafts

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
_SEED_SALT = 0x5DEECE66D  # the draft's stream differs from the request's own


def _draft_params(p: SamplingParams, vocab_size: int) -> SamplingParams:
    """How the draft picks for a request: the request's sampling distribution, nothing that
    only concerns output (stops, logprobs); greedy stays greedy. The cache salt goes along: the
    draft's cache shares no blocks today (prefix caching off), and must not start to across salts.
    A logit bias on an id past the draft's vocabulary (a draft padded less than its target:
    `check_draft_vocabulary`) is the target's alone, as is an allowed id there."""
    if p.temperature == 0.0:
        return _GREEDY if p.cache_salt is None else SamplingParams(temperature=0.0, max_tokens=None,
                                                                  cache_salt=p.cache_salt)
    seed = None if p.seed is None else (p.seed ^ _SEED_SALT) % (1 << 63)
    bias = p.logit_bias if p.logit_bias is None else {t: b for t, b in p.logit_bias.items() if t < vocab_size}
    allowed = [t for t in p.allowed_token_ids or () if t < vocab_size] or None
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=seed,
                          max_tokens=None, logit_bias=bias, allowed_token_ids=allowed, cache_salt=p.cache_salt)


@dataclass
class _Shadow:
    request: Request  # the draft's view: target tokens (+ this step's drafts), computed length in the draft's KV
    base: int = 0  # how many tokens the target had when this step's drafts were appended


def load_draft_model(model_dir: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                     backend: AttentionBackend, max_positions: int, progress: bool = False,
                     tokenizer: Any = None) -> LlamaForCausalLM:
    """The draft's weights, loaded before the KV pool is sized: they count in the memory plan.
    `tokenizer`: the target's (None: the vocabularies are compared by size alone)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    check_draft_vocabulary(model_dir, cfg.vocab_size, target.vocab_size, tokenizer)
    return load_model(model_dir, cfg, dtype, device, backend, max_positions, progress=progress)


def check_draft_vocabulary(model_dir: str, draft_size: int, target_size: int, tokenizer: Any) -> None:
    """A draft must speak the target's tokens. Its tokenizer, where its directory has one, must
    map every token to the target's id: a draft of the same vocabulary size with another
    tokenizer would be taken and accept (almost) nothing. Its vocabulary may be smaller than the
    target's when both cover the tokenizer and differ only in padding rows no token uses
    (Qwen2.5 0.5B-7B pad to 151,936, 14B-72B to 152,064; vLLM takes such pairs too): the draft's
    distribution is padded with zeros to the target's size. ValueError otherwise."""
    draft_tokenizer = _tokenizer_in(model_dir) if tokenizer is not None else None
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError("draft_model: its tokenizer maps tokens to other ids than the target's; "
                         "the draft must share the target's tokenizer")
    if draft_size == target_size:
        return
    if draft_tokenizer is not None and len(tokenizer) <= draft_size < target_size:
        return
    raise ValueError(f"draft_model: its vocabulary ({draft_size}) differs from the target's ({target_size}); "
                     "the draft must share the target's tokenizer (a smaller vocabulary is taken when the "
                     "draft's directory has the same tokenizer and the sizes differ by padding only)")


def _tokenizer_in(model_dir: str) -> Any:
    """The tokenizer in `model_dir`, or None if it has none that loads."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):
        return None


class DraftModelProposer:
    """Drafts with `model` (from `load_draft_model`) over a KV pool of its own of `num_blocks`
    blocks: as many as the target's, which the memory plan counts in its per-block cost."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 block_size: int, max_model_len: int, max_num_tokens: int, max_num_seqs: int,
                 target_vocab_size: int | None = None) -> None:
        self.config = model.config
        # Verification takes q over the target's vocabulary: a draft padded less gets zeros past its own.
        self.pad = (target_vocab_size or self.config.vocab_size) - self.config.vocab_size
        self.model = model
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(self.model, self.kv_caches, self.kv, max_num_tokens, max_num_seqs, max_model_len,
                                  device)
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.device = device
        self._shadows: dict[str, _Shadow] = {}

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        """Up to ks[i] drafts for requests[i] (decoding: every token but the last is
        in the target's cache), and for each the distribution [len, V] its drafts were
        sampled from (None: argmax drafts). [] for a request the draft pool cannot hold."""
        shadows: list[tuple[_Shadow, int]] = []
        for req, k in zip(requests, ks):
            sh = self._shadows.get(req.request_id)
            if sh is None:
                sh = self._shadows[req.request_id] = _Shadow(
                    Request(req.request_id, list(req.all_token_ids), _draft_params(req.params, self.config.vocab_size),
                            max_tokens=1 << 30,
                            device=self.device))
            r = sh.request
            # The target's tokens are the truth. Its first `base` tokens were ours
            # too; after them, keep computed KV only while our drafts match what it kept.
            common = sh.base + _common_prefix(r.all_token_ids[sh.base:], req.all_token_ids[sh.base:],
                                              r.num_computed_tokens - sh.base)
            r.all_token_ids = list(req.all_token_ids)
            # At most all but the last token: the pass that computes it gives the first draft (a
            # shadow left by an earlier request of the same id, were one kept, could claim more).
            r.num_computed_tokens = min(common, r.num_computed_tokens, r.num_tokens - 1)
            sh.base = r.num_tokens
            # KV for every token after the first k drafts' positions.
            if not self.kv.allocate_slots(r, r.num_tokens - r.num_computed_tokens + k):
                self.release(req.request_id)
                continue
            shadows.append((sh, k))
        drafts: dict[str, list[int]] = {sh.request.request_id: [] for sh, _ in shadows}
        probs: dict[str, list[torch.Tensor]] = {}
        stopped: set[str] = set()  # a draft that was no real choice (NaN logits): that request's drafts end
        self._catch_up([sh for sh, _ in shadows], drafts, probs, stopped)
        for step in range(1, max((k for _, k in shadows), default=0)):
            live = [sh for sh, k in shadows if k > step and sh.request.request_id not in stopped]
            if live:
                self._run([ScheduledRequest(sh.request, 1) for sh in live], drafts, probs, stopped)
        tokens = [drafts.get(req.request_id, [])[:k] for req, k in zip(requests, ks)]
        return tokens, [F.pad(torch.stack(probs[r.request_id][:len(t)]), (0, self.pad))
                        if t and r.request_id in probs else None for r, t in zip(requests, tokens)]

    def retain(self, request_ids: set[str]) -> None:
        """Free the draft KV of every request not in `request_ids` (finished, aborted, preempted)."""
        for rid in [r for r in self._shadows if r not in request_ids]:
            self.release(rid)

    def release(self, request_id: str) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is not None:
            self.kv.free(sh.request)

    @property
    def num_tracked(self) -> int:
        return len(self._shadows)

    def _catch_up(self, shadows: list[_Shadow], drafts: dict[str, list[int]],
                  probs: dict[str, list[torch.Tensor]], stopped: set[str]) -> None:
        """Compute every shadow's missing KV, in passes of at most max_num_tokens;
        the pass that reaches a shadow's last token gives its first draft."""
        pending = list(shadows)
        while pending:
            batch: list[ScheduledRequest] = []
            rest: list[_Shadow] = []
            budget = self.max_num_tokens
            for sh in pending:
                r = sh.request
                n = min(r.num_tokens - r.num_computed_tokens, budget)
                if n > 0 and len(batch) < self.max_num_seqs:
                    batch.append(ScheduledRequest(r, n))
                    budget -= n
                    if r.num_computed_tokens + n < r.num_tokens:
                        rest.append(sh)
                else:
                    rest.append(sh)
            if not batch:  # nothing any of them can compute: no drafts for them (never a spin)
                return
            self._run(batch, drafts, probs, stopped)
            pending = rest

    def _run(self, batch: list[ScheduledRequest], drafts: dict[str, list[int]],
             probs: dict[str, list[torch.Tensor]], stopped: set[str]) -> None:
        """One draft pass; a draft that is no real choice (NO_TOKEN: the draft's logits NaN, as
        a draft overflowing in 16 bits makes them) is not kept, and its request drafts no more
        this step: a broken draft costs drafts, never the target's output."""
        sampled = set()
        if batch:
            result = self.runner.execute(batch, want_probs=True)
            tokens = result.output.token_ids.tolist()
            for row, (req, token) in enumerate(zip(result.sampled, tokens)):
                if not 0 <= token < self.config.vocab_size:
                    stopped.add(req.request_id)
                    continue
                drafts[req.request_id].append(token)
                sampled.add(req.request_id)
                if result.probs is not None and req.params.temperature > 0.0:
                    probs.setdefault(req.request_id, []).append(result.probs[row])
        for s in batch:
            s.request.num_computed_tokens += s.num_tokens
            if s.request.request_id in sampled:
                s.request.all_token_ids.append(drafts[s.request.request_id][-1])


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = max(0, min(limit, len(a), len(b)))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
