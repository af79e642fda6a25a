"""Which requests draft, how many tokens, and what their verifications taught.

The engine owns the requests and the steps; this owns the speculative side of
them: the proposer (n-gram lookup or a draft model), the measured price of a
draft (workers/spec/cost.py), each request's rolling acceptance rate and the
engine-wide one new requests start from, and the acceptance counters.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from pdserve.workers.config import EngineConfig
from pdserve.workers.request import Request
from pdserve.workers.spec.cost import Price, SpecCostModel
from pdserve.workers.spec.proposer import Proposer

log = logging.getLogger(__name__)

_EMA = 0.3  # weight of the newest verification in a request's rolling acceptance rate
_GLOBAL_EMA = 0.05  # the same for the engine-wide rate new requests start from
_PROBE_STEPS = 16
_PROBE_BUDGET = 1 / 64  # share of decode time probes may spend (a probe costs its price)
_PRIOR_COST = 0.25  # per-token price until measured (of the order docs/speculative.md reports for n-gram)


class SpecStats(Protocol):
    """Counters of drafting and acceptance (EngineStats has them)."""

    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_position: list[int]


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        pinned = config.spec_token_cost
        self.cost = SpecCostModel(_PRIOR_COST if pinned is None else pinned, fixed=pinned is not None)
        # Acceptance rate over all recent verifications: where a new request starts
        # (starting every request at 1 made each one pay for a few rejected full drafts).
        self.acceptance = 1.0

    def dormant(self, batch: int) -> bool:
        """Whether no request drafts at this many decoding requests (a big batch is compute-bound,
        or drafts do not pay at the measured price): then a step needs none of the last one's
        tokens on the host, and async scheduling may launch it before they land."""
        return batch > self.config.spec_max_batch_size or self.cost.wants_plain_step(batch)

    def propose(self, running: list[Request]) -> None:
        """Draft tokens for every decoding request that speculates, for the next step."""
        # Drafts not verified last step (no room for them, or a plain step) are stale:
        # the limits they were cut to (min_tokens, max_model_len) moved since.
        for req in running:
            req.spec_token_ids, req.spec_draft_probs = [], None
        self.proposer.retain({r.request_id for r in running})  # a draft model frees the KV of those that left
        batch = len(running)
        if self.dormant(batch):
            return
        price = self.cost.price(batch)
        # Until the price is measured, explore with one draft: at the prior price a
        # draft model could spend many tokens' worth on drafts that never pay.
        k_cap = self.config.num_speculative_tokens if self.cost.measured(batch) else 1
        candidates: list[tuple[Request, int]] = []
        for req in running:
            if not _may_draft(req):
                continue
            k = min(self.draft_length(req, price), k_cap, req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1, _min_tokens_room(req))
            if k > 0:
                candidates.append((req, k))
        if not candidates:
            return
        start = time.perf_counter()
        try:
            drafts, probs = self.proposer.draft([r for r, _ in candidates], [k for _, k in candidates])
        except Exception:  # noqa: BLE001 - drafts are a hint: a proposer that fails costs this step's drafts
            log.warning("speculation: the proposer failed; this step goes on without drafts", exc_info=True)
            self.proposer.retain(set())  # whatever state it kept for them may be half-updated
            return
        self.cost.observe_propose(time.perf_counter() - start, sum(len(d) for d in drafts))
        for (req, _), d, sampled_from in zip(candidates, drafts, probs):
            if req.grammar is not None and d:  # a draft ends at the first token its grammar refuses
                # (a sampled one just after it: verification must reject it, as the target's law needs)
                keep = req.grammar.valid_drafts(d, keep_refused=sampled_from is not None)
                d = d[:keep]
                sampled_from = None if sampled_from is None or not keep else sampled_from[:keep]
            req.spec_token_ids, req.spec_draft_probs = d, sampled_from
            if d:
                req.spec_idle_steps = 0

    def draft_length(self, req: Request, price: Price) -> int:
        """How many drafts pay for this request: the k that maximises the
        expected tokens they add, a + a^2 + ... + a^k (a: its rolling acceptance
        rate), minus their price (workers/spec/cost.py). A request for which no
        k pays stops drafting and probes with one draft now and then, so it can
        recover; probes are rarer the dearer a draft is, so they cost at most
        about _PROBE_BUDGET of the decode time."""
        a, k_max = req.spec_acceptance, self.config.num_speculative_tokens
        best_k, best_gain, gain, chance = 0, 0.0, -price.fixed, 1.0
        for k in range(1, k_max + 1):
            chance *= a
            gain += chance - price.per_token
            if gain >= best_gain - 1e-12 and gain > 0:  # ties: the longer draft
                best_k, best_gain = k, gain
        if best_k:
            return best_k
        req.spec_idle_steps += 1
        probe_cost = price.fixed + price.per_token
        probe_every = max(_PROBE_STEPS, math.ceil(probe_cost / _PROBE_BUDGET - 1e-6))
        return 1 if req.spec_idle_steps >= probe_every else 0

    def verified(self, req: Request, num_drafts: int, accepted: int, stats: SpecStats) -> None:
        """Count one verification of `num_drafts` drafts and update the acceptance rates."""
        stats.spec_drafts += 1
        stats.spec_draft_tokens += num_drafts
        stats.spec_accepted_tokens += accepted
        per_position = stats.spec_accepted_per_position
        if len(per_position) < num_drafts:
            per_position.extend([0] * (num_drafts - len(per_position)))
        for i in range(accepted):
            per_position[i] += 1
        rate = accepted / num_drafts
        req.spec_acceptance = (1 - _EMA) * req.spec_acceptance + _EMA * rate
        self.acceptance = (1 - _GLOBAL_EMA) * self.acceptance + _GLOBAL_EMA * rate


def _may_draft(req: Request) -> bool:
    """No drafts while the request is not at its last token, has opted out, sets a
    penalty or bad words (they depend on each position's history), or samples with a seed: verifying
    drafts spends its seeded draws otherwise than plain steps do, and how many drafts a
    request gets depends on the batch (its size, the measured price), so its tokens
    would depend on what else runs, which a seed promises they do not."""
    p = req.params
    return (req.num_computed_tokens == req.num_tokens - 1 and p.speculative and not p.depends_on_history
            and (p.seed is None or p.temperature == 0.0))


def _min_tokens_room(req: Request) -> int:
    """Under min_tokens, verification bans the stop tokens at every position of
    the row: draft only as far as every position is still under the limit. Not at all
    under a grammar: the ban gives way where the grammar allows nothing but a stop token
    (its end ends the request), which the row's first position decides for all of them, so
    a draft that completed the grammar left a later position nothing and failed the request
    that plain decoding ends with "stop"."""
    if req.num_output_tokens >= req.params.min_tokens or not req.stop_token_ids:
        return 1 << 30
    if req.grammar is not None:
        return 0
    return req.params.min_tokens - req.num_output_tokens - 1

