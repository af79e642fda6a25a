"""Speculative decoding in the engine (n-gram drafts, greedy verification):
the same tokens as without it, and the same KV after drafts are rolled back."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.request import Request
from pdserve.workers.spec.cost import Price, SpecCostModel
from pdserve.workers.spec.proposer import Drafts
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


def prompts(n: int = 6) -> list[list[int]]:
    """Repetitive prompts (n-gram drafts find matches) and random ones (they find few)."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        if i % 2:
            out.append([rng.randrange(5, 4000) for _ in range(40 + 7 * i)])
        else:
            motif = [rng.randrange(5, 4000) for _ in range(5 + i)]
            out.append((motif * 12)[: 50 + 9 * i])
    return out


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


def _kv_of(engine: LLMEngine, request_id: str, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    blocks = engine.kv.blocks_of(request_id)
    bs = engine.config.block_size
    out = []
    for k_cache, v_cache in engine.kv_caches:
        k = k_cache[blocks].flatten(0, 1)[:num_tokens]
        v = v_cache[blocks].flatten(0, 1)[:num_tokens]
        out.append((k.clone(), v.clone()))
    assert len(blocks) * bs >= num_tokens
    return out


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
        runs[name] = (tokens, _kv_of(engine, "r", computed), engine.stats)
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


class _FixedDrafts:
    """Drafts the same tokens every time: some the target likes, some it does not,
    so verification both accepts and resamples."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        return [self.tokens[:k] for k in ks], [None] * len(ks)

    def retain(self, request_ids: set[str]) -> None:
        pass


def _exact_joint(model_dir: Path, prompt: list[int], temperature: float, top_k: int,
                 depth: int) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) under temperature + top-k sampling, in float64 with transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()

    def law(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1] / temperature
        top = logits.topk(top_k)
        probs = top.values.softmax(-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        joint = {seq + (t,): p * q for seq, p in joint.items() for t, q in law(list(seq)).items()}
    return joint


def _sample_joint(model_dir: Path, prompt: list[int], params: SamplingParams, n: int,
                  drafts: list[int] | None,
                  draft_model: Path | None = None) -> tuple[dict[tuple[int, ...], float], LLMEngine]:
    # The cost is pinned: this test is about the law, drafts must be made at any batch size.
    extra: dict[str, object] = {"speculative": "ngram", "num_speculative_tokens": len(drafts),
                                "spec_max_batch_size": 256,
                                "spec_token_cost": 0.001} if drafts else {}
    if draft_model is not None:
        extra = {"speculative": "draft", "draft_model": str(draft_model), "num_speculative_tokens": 2,
                 "spec_max_batch_size": 256, "spec_token_cost": 0.001}
    llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=256, progress=False, **extra)
    if drafts:
        llm.engine.spec.proposer = _FixedDrafts(drafts)  # type: ignore[assignment]
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([prompt] * n, params):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return {k: c / n for k, c in counts.items()}, llm.engine


def _tv(a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())


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
    exact = _exact_joint(model_dir, prompt, 0.8, 4, depth=3)
    likely = max(exact, key=exact.get)  # the most likely 3 tokens: the first two serve as drafts
    drafts = [likely[1], likely[0]]  # after t1, draft t2 := the likely one, t3 := an unlikely one
    n = 20_000
    bound = lambda m: 0.5 * (64 / m) ** 0.5 + (np.log(1e6) / (2 * m)) ** 0.5  # noqa: E731
    got, engine = _sample_joint(model_dir, prompt, params, n, drafts)
    assert engine.stats.spec_drafts > n // 2 and 0 < engine.stats.spec_accepted_tokens < engine.stats.spec_draft_tokens
    assert _tv(got, exact) < bound(n), _tv(got, exact)

    import pdserve.workers.model_runner as runner
    from pdserve.workers.spec.rejection import Verified

    def accept_all(logits, draft_tokens, num_drafts, batch, draft_probs=None):  # noqa: ANN001, ANN202
        tokens = [draft_tokens[b, :k].tolist() + [int(logits[b, k].argmax())] for b, k in enumerate(num_drafts)]
        return Verified(tokens, list(num_drafts))

    monkeypatch.setattr(runner, "verify", accept_all)
    m = 5_000
    biased, _ = _sample_joint(model_dir, prompt, params, m, drafts)
    assert _tv(biased, exact) > bound(m), _tv(biased, exact)


@pytest.fixture(scope="module")
def draft_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    """A 1-layer model with the same tokenizer and vocabulary (other random weights)."""
    return make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.05, seed=7))


@pytest.mark.parametrize("draft", ["other", "self"])
def test_greedy_output_with_a_draft_model_equals_without(model_dir: Path, draft_dir: Path, draft: str) -> None:
    """A different draft (mostly rejected) and the target itself as draft (mostly
    accepted): tokens as without speculation, mixed with requests that turn it
    off; the draft's KV is freed when requests end."""
    ps = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True, speculative=i % 3 != 1)
              for i in range(len(ps))]
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), max_model_len=512, progress=False).generate(ps, params)]
    path = draft_dir if draft == "other" else model_dir
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(path),
               num_speculative_tokens=3, spec_max_batch_size=64)
    assert [o.outputs[0].token_ids for o in spec.generate(ps, params)] == want
    st = spec.engine.stats
    assert st.spec_drafts > 0
    if draft == "self":
        assert st.spec_accepted_tokens >= 0.9 * st.spec_draft_tokens
    proposer = spec.engine.spec.proposer
    assert proposer.num_tracked == 0 and proposer.kv.pool.num_used == 0  # type: ignore[union-attr]
    assert spec.engine.kv.pool.num_used == 0


@pytest.fixture(scope="module")
def near_draft_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on its weights: a law close to the target's but not
    equal (two unrelated random models share no top-4 token: nothing would be accepted)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near-draft")
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point()
                   and v.dim() == 2 else v for k, v in weights.items()}, f, metadata={"format": "pt"})
    return out


def test_sampled_drafts_of_a_draft_model_keep_the_targets_distribution(model_dir: Path, near_draft_dir: Path) -> None:
    """For a random request the draft model samples from its own law q (under the
    request's temperature and top-k) and hands q to verification: the joint law of
    the first 3 tokens is still the target's (the bound of the test above)."""
    prompt = prompts()[1][:24]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=3, ignore_eos=True, detokenize=False)
    exact = _exact_joint(model_dir, prompt, 0.8, 4, depth=3)
    n = 20_000
    got, engine = _sample_joint(model_dir, prompt, params, n, None, draft_model=near_draft_dir)
    st = engine.stats
    assert st.spec_drafts > n // 2 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert _tv(got, exact) < 0.5 * (64 / n) ** 0.5 + (np.log(1e6) / (2 * n)) ** 0.5, _tv(got, exact)


def test_the_target_as_its_own_sampling_draft_is_always_accepted(model_dir: Path) -> None:
    """q = p when the draft is the target: every sampled draft is accepted (an
    argmax draft would be accepted only with probability p(argmax)). A seeded
    request gives the same tokens alone and batched."""
    ps = prompts(4)
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(model_dir),
               num_speculative_tokens=3, spec_max_batch_size=64, spec_token_cost=0.01)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, ignore_eos=True, seed=3)
    alone = spec.generate([ps[0]], params)[0].outputs[0].token_ids
    st = spec.engine.stats
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens >= 0.98 * st.spec_draft_tokens
    others = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    batched = spec.generate(ps, [params, others, others, others])[0].outputs[0].token_ids
    assert batched == alone


def test_a_draft_with_another_vocabulary_is_refused(model_dir: Path,
                                                    make_model: Callable[[TinyModelSpec], Path]) -> None:
    other = make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=512))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(other))
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=str(model_dir), speculative="draft")


def test_draft_kv_after_rejections_equals_a_fresh_draft_prefill(model_dir: Path, draft_dir: Path) -> None:
    """The draft's own cache is rewound too: mid-generation, after many rejected
    drafts, its KV for the tokens it counts as computed equals the draft model's
    KV for those tokens computed from scratch."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, speculative="draft",
                                    draft_model=str(draft_dir), num_speculative_tokens=3,
                                    spec_token_cost=0.001))  # keep drafting although it fails
    engine.add_request("r", prompts()[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(25):
        engine.step()
    st = engine.stats
    assert st.spec_draft_tokens - st.spec_accepted_tokens >= 10, "the test needs rejected drafts"
    proposer = engine.spec.proposer
    shadow = proposer._shadows["r"].request  # type: ignore[union-attr]
    n = shadow.num_computed_tokens
    fresh = LLMEngine(EngineConfig(model=str(draft_dir), max_model_len=512, enable_prefix_caching=False))
    fresh.add_request("f", shadow.all_token_ids[:n], SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while fresh.has_unfinished_requests():
        fresh.step()
    got = _kv_of(_Caches(proposer.kv, proposer.kv_caches, engine.config.block_size), "r", n)  # type: ignore[union-attr]
    for (k0, v0), (k1, v1) in zip(_kv_of(fresh, "f", n), got):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


class _Caches:
    """What `_kv_of` reads from an engine: its block tables and its caches."""

    def __init__(self, kv: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        self.kv, self.kv_caches = kv, kv_caches
        self.config = type("C", (), {"block_size": block_size})()


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
