"""Speculative decoding in the engine (n-gram drafts, greedy verification):
the same tokens as without it, and the same KV after drafts are rolled back.
Drafts of a draft model: test_spec_decode_draft.py; the price of drafting: test_spec_decode_cost.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from spec_decode_helpers import check_law_kept, exact_joint, kv_of, prompts, target_dir

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.request import Request
from pdserve.workers.spec.cost import Price
from pdserve.workers.spec.proposer import Drafts
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return target_dir(make_model)


def test_config_rejects_bad_speculation_settings(model_dir: Path) -> None:
    for bad in ({"speculative": "medusa"}, {"num_speculative_tokens": 0}, {"spec_ngram_min": 3, "spec_ngram_max": 2}):
        with pytest.raises(ValueError):
            EngineConfig(model=str(model_dir), **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_ngram_speculation_equals_without(model_dir: Path, k: int) -> None:
    """Also batched with requests that turned it off, and with max_tokens that cut a draft short."""
    ps = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 3 * i, ignore_eos=True, speculative=i % 3 != 1)
              for i in range(len(ps))]
    plain = LLM(str(model_dir), max_model_len=512, progress=False)
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=k,
               spec_max_batch_size=64)
    want = [o.outputs[0].token_ids for o in plain.generate(ps, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(ps, params)]
    assert got == want
    st = spec.engine.stats
    assert st.spec_drafts > 0 and st.spec_accepted_tokens > 0  # it did speculate, and some drafts held
    assert st.spec_accepted_tokens <= st.spec_draft_tokens
    assert sum(st.spec_accepted_per_position) == st.spec_accepted_tokens
    assert spec.engine.kv.pool.num_used == 0


def test_requests_under_min_tokens_draft_only_up_to_the_limit(model_dir: Path) -> None:
    """Under min_tokens the stop tokens are banned at every verified position, so
    drafts must stop short of the limit. The stop token is the one the free run
    first emits at position s >= 10, and min_tokens = s: the request must stop
    right there. Drafts are always right (read off the free run): a draft window
    reaching past the limit would ban the stop token at s and run on."""
    prompt = prompts()[1]
    free = LLM(str(model_dir), max_model_len=512, progress=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0].outputs[0].token_ids
    s = next(i for i in range(10, 60) if free[i] not in free[:i])
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, min_tokens=s, stop_token_ids=[free[s]])
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=4,
               spec_token_cost=0.01)
    spec.engine.spec.proposer = _Oracle(prompt, free, 0.0)  # type: ignore[union-attr]
    out = spec.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == free[: s + 1] and out.finish_reason == "stop"
    assert spec.engine.stats.spec_accepted_tokens >= s // 2  # it did draft while under the limit


def test_drafts_left_unverified_are_dropped_before_the_next_step(model_dir: Path) -> None:
    """A step that could not verify a request's drafts (no room) leaves them behind;
    they were cut to limits (min_tokens, max_model_len) that have moved since, so
    the next proposal starts from none, even when it drafts nothing."""

    llm = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", spec_max_batch_size=1)
    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8), max_tokens=8) for i in range(2)]
    reqs[0].spec_token_ids, reqs[0].spec_draft_probs = [1, 2, 3], torch.zeros(3, 4)
    llm.engine.spec.propose(reqs)  # two running > spec_max_batch_size: nobody drafts this time
    assert reqs[0].spec_token_ids == [] and reqs[0].spec_draft_probs is None


def test_logprobs_requests_speculate_and_get_the_same_logprobs(model_dir: Path) -> None:
    """Verification reports the raw log-probs of every emitted token (the accepted
    drafts and the target's own), the same as one-token decode steps give."""
    ps = prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    plain = LLM(str(model_dir), max_model_len=512, progress=False).generate(ps, params)
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=4,
               spec_max_batch_size=64, spec_token_cost=0.01)
    got = spec.generate(ps, params)
    assert spec.engine.stats.spec_accepted_tokens > 0
    for a, b in zip(got, plain):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and len(ca.logprobs) == len(cb.logprobs) == 30
        for ea, eb in zip(ca.logprobs, cb.logprobs):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)
        assert abs(ca.cumulative_logprob - cb.cumulative_logprob) < 1e-3


def test_kv_after_many_rejected_drafts_equals_kv_without_speculation(model_dir: Path) -> None:
    """A random model rejects most n-gram drafts: their KV is written, then rolled
    back. The cache of the final sequence must hold exactly the plain run's KV."""
    prompt = prompts()[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative": "ngram", "num_speculative_tokens": 4,
                                                     "spec_token_cost": 0.01})):
        engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, enable_prefix_caching=False, **extra))
        engine.add_request("r", prompt, params, hold_kv=True)  # keep the blocks after it finishes
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
        computed = len(prompt) + len(tokens) - 1  # the last token's KV is never computed
        runs[name] = (tokens, kv_of(engine, "r", computed), engine.stats)
    (t_plain, kv_plain, _), (t_spec, kv_spec, st) = runs["plain"], runs["spec"]
    assert t_spec == t_plain
    assert st.spec_draft_tokens - st.spec_accepted_tokens >= 10, "the test needs rejected drafts"
    for (k0, v0), (k1, v1) in zip(kv_plain, kv_spec):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


def test_draft_length_follows_each_requests_acceptance(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, speculative="ngram",
                                    num_speculative_tokens=6, spec_token_cost=0.25))
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
    req = engine.scheduler.waiting[0]
    # The i-th draft is made while acceptance**i >= cost.
    for acceptance, k in ((1.0, 6), (0.9, 6), (0.6, 2), (0.5, 2), (0.3, 1)):
        req.spec_acceptance = acceptance
        assert engine.spec.draft_length(req, Price(0.0, 0.25)) == k, acceptance
    req.spec_acceptance = 0.1  # below the cost: no drafts, but a probe now and then
    lengths = [engine.spec.draft_length(req, Price(0.0, 0.25)) for _ in range(20)]
    assert lengths[:15] == [0] * 15 and lengths[15] == 1
    # A fixed price per verification asks for longer drafts, or none.
    for acceptance, k in ((0.9, 6), (0.6, 2), (0.3, 0)):
        req.spec_acceptance, req.spec_idle_steps = acceptance, 0
        assert engine.spec.draft_length(req, Price(0.3, 0.25)) == k, acceptance
    # Dear drafts probe more rarely (a probe costs its price).
    req.spec_acceptance, req.spec_idle_steps = 1.0, 0
    lengths = [engine.spec.draft_length(req, Price(0.5, 1.0)) for _ in range(96)]
    assert lengths[:95] == [0] * 95 and lengths[95] == 1  # a probe after (0.5 + 1.0) * 64 = 96 steps


class _WrongDrafts:
    """A proposer whose drafts the target never accepts (a token it never picks)."""

    def __init__(self, token: int) -> None:
        self.token, self.calls = token, 0

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        self.calls += len(requests)
        return [[self.token] * k for k in ks], [None] * len(ks)

    def retain(self, request_ids: set[str]) -> None:
        pass


def test_drafting_backs_off_when_drafts_are_rejected_and_stops_for_big_batches(model_dir: Path) -> None:
    """Drafts that are always wrong: the rolling rate drops, the request drafts
    only an occasional probe, the output stays exact; above spec_max_batch_size
    nobody drafts."""
    prompt = prompts()[1]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain = LLM(str(model_dir), max_model_len=512, progress=False).generate([prompt], params)[0].outputs[0].token_ids
    never = next(t for t in range(5, 4000) if t not in plain)
    llm = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=4)
    llm.engine.spec.proposer = _WrongDrafts(never)  # type: ignore[assignment]
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    st = llm.engine.stats
    assert st.spec_accepted_tokens == 0
    # Optimistic start: 4 drafts, then fewer, then nothing but one-token probes every 16 steps.
    assert st.spec_draft_tokens <= 4 + 3 + 2 + 1 + 120 // 16, st.spec_draft_tokens
    off = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", spec_max_batch_size=1)
    off.generate([prompt, prompts()[0]], params)
    assert off.engine.stats.spec_drafts == 0


class _Oracle:
    """Drafts exactly what the target will say (read off a plain run), taking
    `delay_s` per call: drafts that are always accepted, at a chosen price."""

    def __init__(self, prompt: list[int], plain: list[int], delay_s: float) -> None:
        self.full, self.delay_s = prompt + plain, delay_s

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        drafts = []
        for req, k in zip(requests, ks):
            time.sleep(self.delay_s)
            drafts.append(self.full[req.num_tokens:req.num_tokens + k])
        return drafts, [None] * len(drafts)

    def retain(self, request_ids: set[str]) -> None:
        pass


def test_drafting_stops_when_the_measured_price_of_a_draft_exceeds_its_worth(model_dir: Path) -> None:
    """Drafts that are always right but dearer than a decode step (50 ms a call
    against a few ms a step) stop after the cost is measured; the same drafts
    at no cost are made all along."""
    prompt = prompts()[1]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    plain = LLM(str(model_dir), max_model_len=512, progress=False).generate([prompt], params)[0].outputs[0].token_ids
    drafted = {}
    for delay in (0.0, 0.05):
        llm = LLM(str(model_dir), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=4)
        llm.engine.spec.proposer = _Oracle(prompt, plain, delay)  # type: ignore[assignment]
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
        st = llm.engine.stats
        assert st.spec_accepted_tokens == st.spec_draft_tokens  # the oracle is never wrong
        drafted[delay] = st.spec_draft_tokens
    assert drafted[0.0] >= 60, drafted  # free and right: nearly every token is drafted
    # Dear: drafts until both times are measured (a few steps), then probes at most.
    from pdserve.workers.spec.cost import _MIN_SAMPLES, _WARMUP

    assert drafted[0.05] <= 4 * (_WARMUP + _MIN_SAMPLES) + 2, drafted


def test_sampling_with_speculation_keeps_the_targets_distribution(model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The joint law of the first 3 sampled tokens (temperature 0.8, top-k 4: 64
    outcomes) with drafts verified by rejection sampling equals the target's,
    computed exactly in float64. 20,000 samples; bound on the total variation:
    E[TV] <= 0.5 * sqrt(64 / n) = 0.028, plus sqrt(ln(1e6) / 2n) = 0.019 for a
    1e-6 chance of a false alarm. A verifier that accepts every draft (the
    negative control) must break the same bound."""
    prompt = prompts()[1][:24]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=3, ignore_eos=True, detokenize=False)
    check_law_kept(model_dir, prompt, params, exact_joint(model_dir, prompt, 0.8, 4, depth=3), monkeypatch)
