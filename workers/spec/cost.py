"""What drafting costs, measured on this machine while serving.

A request that drafts k tokens, each accepted with probability a (its rolling
acceptance rate), gains a + a^2 + ... + a^k tokens in expectation. A token is
worth u = T / B seconds: the time a plain decode step of B sequences spends per
sequence. Drafting is paid in seconds:

- verification: a step that verifies drafts costs more than a plain one by a
  fixed part F (another attention path, the verification itself; on a small
  CPU model a large share of a step: docs/speculative.md) plus c per verified token;
- proposing: p per drafted token (a lookup for n-gram; one forward pass of the
  draft model per position).

`price` returns (F, c + p) in units of u, and the engine picks the k that
maximises gain - price (workers/spec/planner.py `Speculator.draft_length`). F and c come from a
least-squares line through the median extra seconds of recent verify steps at
each draft length; times are medians over a window of recent steps, per batch
size (a first call on a new shape can take 100x a normal step: a mean would
keep drafting off long after), so the choice follows the hardware, the model
pair and the load: on a GPU verification is nearly free and a draft model
cheap; on a small CPU a draft-model pass costs half a target step and only
near-certain drafts pay.

Plain steps of B sequences stop happening once every request drafts, so the
reference time T would go stale: after `stale_steps` verify steps without one,
`wants_plain_step` asks the engine for a step without drafts.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

_MAX_PRICE = 10.0
_WINDOW = 32  # recent steps per batch size (and proposals) that the medians see
_MIN_SAMPLES = 8  # verify steps before the measured price replaces the prior
_WARMUP = 2  # first verify steps per batch size, not counted: first calls on new shapes are slow
# Verify steps older than this many observed steps no longer count. Once drafting
# stops, only rare probes add verify samples, so a window spoilt by a load spike
# would keep drafting off for good; aged out, the price falls back to the prior
# and a few verify steps measure it afresh (at most ~1% of steps at this age).
_MAX_AGE_STEPS = 1024
_REPRICE_STEPS = 8


@dataclass(frozen=True)
class Price:
    """Drafting's price in tokens' worth: `fixed` once per verifying request, `per_token` per draft."""

    fixed: float
    per_token: float


@dataclass
class _PerBatch:
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))  # seconds of plain decode steps
    # (drafts, seconds, the model's step count when seen)
    verify: deque[tuple[int, float, int]] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    steps_since_plain: int = 0
    warmup_left: int = _WARMUP

    def fixed_and_per_token(self, plain_s: float) -> tuple[float, float]:
        """Seconds: the fixed extra of a verify step and the extra per drafted token."""
        by_k: dict[int, list[float]] = {}
        for k, seconds, _ in self.verify:
            by_k.setdefault(k, []).append(seconds - plain_s)
        points = [(k, statistics.median(e), len(e)) for k, e in by_k.items()]
        if len(points) >= 2:  # least squares over the per-length medians, weighted by their counts
            w = sum(n for _, _, n in points)
            mk = sum(k * n for k, _, n in points) / w
            me = sum(e * n for _, e, n in points) / w
            var = sum(n * (k - mk) ** 2 for k, _, n in points) / w
            slope = sum(n * (k - mk) * (e - me) for k, e, n in points) / w / var
            fixed = me - slope * mk
            if slope >= 0 and fixed >= 0:
                return fixed, slope
        # One draft length seen (or a line that makes no sense): all of it per token.
        k, e, _ = max(points, key=lambda p: p[2])
        return 0.0, max(e, 0.0) / k


class SpecCostModel:
    def __init__(self, prior: float, fixed: bool = False, stale_steps: int = 64) -> None:
        """prior: the per-token price used until the times are measured (and
        always if `fixed`, e.g. a user-pinned spec_token_cost), with no fixed part."""
        self.prior, self.fixed, self.stale_steps = prior, fixed, stale_steps
        self._batches: dict[int, _PerBatch] = {}
        self._propose: deque[float] = deque(maxlen=_WINDOW)  # seconds per drafted token
        self._steps = 0
        # The engine asks every step and medians over the windows cost ~20 us: the
        # price is recomputed when a verify step or a proposal was seen, or after
        # _REPRICE_STEPS plain steps (which only move the reference slowly).
        self._cached: dict[int, tuple[int, int, Price]] = {}
        self._version = 0

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode-only step (no prompt tokens) of `batch` sequences and
        `tokens` query tokens in all (batch + the drafts it verified)."""
        self._steps += 1
        b = self._batches.setdefault(batch, _PerBatch())
        if tokens <= batch:
            b.plain.append(seconds)
            b.steps_since_plain = 0
        else:
            b.steps_since_plain += 1
            if b.warmup_left:
                b.warmup_left -= 1
            else:
                b.verify.append((tokens - batch, seconds, self._steps))
                self._version += 1

    def observe_propose(self, seconds: float, drafted_tokens: int) -> None:
        if drafted_tokens > 0:
            self._propose.append(seconds / drafted_tokens)
            self._version += 1

    def price(self, batch: int) -> Price:
        """What drafting costs a request in a batch of `batch` decoding
        sequences, in units of the worth of one token."""
        cached = self._cached.get(batch)
        if cached is not None and cached[1] == self._version and self._steps - cached[0] < _REPRICE_STEPS:
            return cached[2]
        price = self._price(batch)
        self._cached[batch] = (self._steps, self._version, price)
        return price

    def _price(self, batch: int) -> Price:
        b = self._batches.get(batch)
        if b is not None:
            while b.verify and b.verify[0][2] < self._steps - _MAX_AGE_STEPS:
                b.verify.popleft()
        if self.fixed or b is None or not b.plain or len(b.verify) < _MIN_SAMPLES:
            return Price(0.0, self.prior)
        plain_s = statistics.median(b.plain)
        fixed_s, token_s = b.fixed_and_per_token(plain_s)
        propose_s = statistics.median(self._propose) if self._propose else 0.0
        worth = plain_s / batch
        return Price(min(fixed_s / worth, _MAX_PRICE), min((token_s + propose_s) / worth, _MAX_PRICE))

    def measured(self, batch: int) -> bool:
        """Whether `price(batch)` is measured (or pinned) rather than the prior."""
        b = self._batches.get(batch)
        return self.fixed or (b is not None and bool(b.plain) and len(b.verify) >= _MIN_SAMPLES)

    def wants_plain_step(self, batch: int) -> bool:
        if self.fixed:
            return False
        b = self._batches.get(batch)
        return b is None or not b.plain or b.steps_since_plain >= self.stale_steps
