"""The price of drafting (`SpecCostModel`): measured per batch size against the worth of a token,
split into a fixed part per verification and a part per draft token, and aged out."""

from __future__ import annotations

import pytest

from pdserve.workers.spec.cost import Price, SpecCostModel


def test_price_of_drafting_is_measured_against_the_worth_of_a_token() -> None:
    cost = SpecCostModel(prior=0.25, stale_steps=12)
    assert cost.price(2) == Price(0.0, 0.25) and cost.wants_plain_step(2)  # nothing measured: the prior
    cost.observe_step(2, 2, 0.010)  # plain: 10 ms for 2 sequences, a token is worth 5 ms
    for seconds in (0.9, 0.7, 0.5):  # first calls on a new shape: warm-up, then an outlier the medians ignore
        cost.observe_step(2, 6, seconds)
    assert cost.price(2) == Price(0.0, 0.25)  # still too few verify steps
    for _ in range(7):
        cost.observe_step(2, 6, 0.014)  # 4 drafts verified: +4 ms
    cost.observe_propose(0.002, 4)  # proposing: 0.5 ms a draft
    assert not cost.wants_plain_step(2)
    # One draft length seen: all of it is charged per token.
    assert cost.price(2).fixed == 0.0 and cost.price(2).per_token == pytest.approx((0.001 + 0.0005) / 0.005)
    assert cost.price(1) == Price(0.0, 0.25)  # another batch size is measured apart
    cost.observe_step(2, 6, 0.014)
    cost.observe_step(2, 6, 0.014)
    assert cost.wants_plain_step(2)  # 12 verify steps without a plain one: refresh the reference
    pinned = SpecCostModel(prior=0.1, fixed=True)
    for tokens, seconds in [(1, 0.01)] + [(5, 1.0)] * 12:
        pinned.observe_step(1, tokens, seconds)
    assert pinned.price(1) == Price(0.0, 0.1) and not pinned.wants_plain_step(1)


def test_price_separates_the_fixed_part_of_a_verification_from_the_per_token_part() -> None:
    cost = SpecCostModel(prior=0.25)
    cost.observe_step(1, 1, 0.002)  # a plain step: 2 ms, the worth of a token
    for _ in range(8):  # extra time = 0.8 ms + 0.3 ms per draft, drafts of 1..4 tokens
        for k in (1, 4, 2, 3):
            cost.observe_step(1, 1 + k, 0.002 + 0.0008 + 0.0003 * k)
    price = cost.price(1)
    assert price.fixed == pytest.approx(0.4, abs=1e-6) and price.per_token == pytest.approx(0.15, abs=1e-6)


def test_a_spoilt_price_ages_out() -> None:
    """Verify steps slowed by a load spike make drafting look dear; once drafting
    stops they are not replaced, so they must expire, back to the prior."""
    from pdserve.workers.spec.cost import _MAX_AGE_STEPS

    cost = SpecCostModel(prior=0.25)
    cost.observe_step(1, 1, 0.002)
    for _ in range(12):
        cost.observe_step(1, 5, 0.200)  # 100x a normal step
    assert cost.price(1).per_token == 10.0  # capped
    for _ in range(_MAX_AGE_STEPS):
        cost.observe_step(1, 1, 0.002)  # drafting is off: plain steps only
    assert cost.price(1) == Price(0.0, 0.25)
