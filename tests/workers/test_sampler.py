"""The sampler against a float64 reference: greedy, temperature, top-k, top-p,
min-p, seeds, banned tokens (min_tokens) and logprobs.

Distribution checks compare many draws with the reference law by total
variation. The bound is computed from the sample size: E[TV] <= sqrt(k/n)/2
(Cauchy-Schwarz over k categories) and, one draw moving TV by at most 1/n,
McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2). With DELTA = 1e-6 a
correct sampler fails by chance about once in a million runs; the global RNG
is seeded anyway, so every run is the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.workers import sampler
from pdserve.workers.sampler import SamplingBatch, apply_top_k_top_p, sample

V = 12
DELTA = 1e-6


# -- reference ------------------------------------------------------------------


def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The law a user expects, in float64: softmax(logits / T), then top-k, top-p, min-p, renormalised."""
    probs = (logits.double() / temperature).softmax(-1)  # [V]
    if top_k:
        kth = probs.sort(descending=True).values[top_k - 1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum()
    if top_p < 1.0:
        probs = probs * nucleus_mask(probs, top_p)
        probs = probs / probs.sum()
    if min_p:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Textbook nucleus: the smallest set of most likely tokens whose total reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    reaches = (sorted_probs.cumsum(-1) >= top_p).nonzero()
    m = int(reaches[0]) + 1 if len(reaches) else len(probs)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[:m]] = True
    return mask


def tv_bound(n: int, k: int = V) -> float:
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def empirical(tokens: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def batch_of(n: int, temperature: float, **filters: float) -> SamplingBatch:
    """A batch of n identical rows; filters given by name (top_k, top_p, min_p)."""
    batch = SamplingBatch(temperature=torch.full((n,), temperature), all_greedy=temperature == 0.0)
    if "top_k" in filters:
        batch.top_k = torch.full((n,), int(filters["top_k"]), dtype=torch.int64)
    if "top_p" in filters:
        batch.top_p = torch.full((n,), float(filters["top_p"]))
    if "min_p" in filters:
        batch.min_p = torch.full((n,), float(filters["min_p"]))
    return batch


@pytest.fixture
def logits() -> torch.Tensor:
    """One row of distinct logits, spread enough that every filter below bites."""
    return torch.tensor([2.0, 1.6, 1.3, 1.1, 0.7, 0.5, 0.2, 0.0, -0.4, -0.9, -1.5, -2.5])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


# -- greedy -----------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_alone_and_mixed_with_random_rows() -> None:
    logits = torch.randn(64, V) * 3
    expected = logits.argmax(-1)

    out = sample(logits.clone(), SamplingBatch(temperature=torch.zeros(64), all_greedy=True))
    assert torch.equal(out.token_ids, expected)

    # Every other row random, with filters that would move a sampled token off the argmax.
    temps = torch.where(torch.arange(64) % 2 == 0, 0.0, 5.0)
    batch = SamplingBatch(temperature=temps, all_greedy=False, top_k=torch.full((64,), V),
                          top_p=torch.full((64,), 0.99), min_p=torch.full((64,), 0.01))
    greedy_rows = temps == 0.0
    for _ in range(20):
        out = sample(logits.clone(), batch)
        assert torch.equal(out.token_ids[greedy_rows], expected[greedy_rows])
    # The random rows really were random (at T=5 they leave the argmax).
    out = sample(logits.clone(), batch)
    assert not torch.equal(out.token_ids[~greedy_rows], expected[~greedy_rows])


# -- distributions ------------------------------------------------------------------


CASES = [
    pytest.param(0.5, {}, id="temperature-0.5"),
    pytest.param(1.0, {}, id="temperature-1"),
    pytest.param(2.0, {}, id="temperature-2"),
    pytest.param(1.0, {"top_k": 4}, id="top-k"),
    pytest.param(1.0, {"top_p": 0.7}, id="top-p"),
    pytest.param(1.0, {"min_p": 0.2}, id="min-p"),
    pytest.param(1.5, {"top_k": 8, "top_p": 0.85, "min_p": 0.1}, id="combined"),
]


@pytest.mark.parametrize(("temperature", "filters"), CASES)
def test_samples_follow_the_reference_law(logits: torch.Tensor, temperature: float, filters: dict[str, float]) -> None:
    n = 50_000
    expected = reference_probs(logits, temperature, **filters)
    out = sample(logits.repeat(n, 1), batch_of(n, temperature, **filters))

    assert tv(empirical(out.token_ids), expected) <= tv_bound(n)
    allowed = expected > 0
    assert allowed[out.token_ids].all(), "a filtered-out token was sampled"
    if filters:
        assert not allowed.all(), "the case should filter something out"


def test_tv_bound_catches_a_wrong_temperature(logits: torch.Tensor) -> None:
    """Negative control: temperature-1 draws are far from the temperature-2 law."""
    n = 50_000
    out = sample(logits.repeat(n, 1), batch_of(n, 1.0))
    assert tv(empirical(out.token_ids), reference_probs(logits, 2.0)) > tv_bound(n)


def test_rows_with_different_settings_each_follow_their_own_law(logits: torch.Tensor) -> None:
    settings = [(0.7, V, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (2.0, V, 0.6, 0.0), (1.3, 6, 0.9, 0.3)]
    per = 40_000
    rows = torch.arange(len(settings)).repeat_interleave(per)

    def col(j: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # column j of settings, one value per row
        return torch.tensor([s[j] for s in settings], dtype=dtype)[rows]

    batch = SamplingBatch(temperature=col(0), all_greedy=False, top_k=col(1, torch.int64), top_p=col(2), min_p=col(3))

    out = sample(logits.repeat(len(rows), 1), batch)

    for i, (t, k, p, m) in enumerate(settings):
        expected = reference_probs(logits, t, top_k=k if k < V else 0, top_p=p, min_p=m)
        got = out.token_ids[rows == i]
        assert tv(empirical(got), expected) <= tv_bound(per), f"row group {i}"
        assert (expected[got] > 0).all()


def test_seeded_rows_follow_the_reference_law(logits: torch.Tensor) -> None:
    n = 20_000
    batch = batch_of(n, 1.0, top_p=0.9)
    batch.generators = {i: torch.Generator().manual_seed(10_000 + i) for i in range(n)}
    out = sample(logits.repeat(n, 1), batch)
    assert tv(empirical(out.token_ids), reference_probs(logits, 1.0, top_p=0.9)) <= tv_bound(n)


# -- top-p semantics ----------------------------------------------------------------


def kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    masked = apply_top_k_top_p(logits.clone()[None], None, torch.tensor([top_p]))[0]
    return masked > float("-inf")


def test_top_p_mask_equals_the_textbook_nucleus_on_random_rows() -> None:
    """The implementation drops sorted tokens whose mass from the least likely side is
    <= 1 - top_p; that must be the smallest most-likely set reaching top_p."""
    torch.manual_seed(0)
    compared = 0
    for _ in range(2000):
        logits = torch.randn(V) * torch.rand(()) * 4
        top_p = float(torch.rand(()) * 0.98 + 0.01)
        probs = logits.double().softmax(-1)
        cum = probs.sort(descending=True).values.cumsum(-1)
        if (cum - top_p).abs().min() < 1e-5:
            continue  # float32 rounding may legitimately flip an exact boundary
        assert torch.equal(kept(logits, top_p), nucleus_mask(probs, top_p)), (logits, top_p)
        compared += 1
    assert compared > 1900


def test_top_p_at_ties_keeps_the_smallest_set() -> None:
    # probs [0.4, 0.2, 0.2, 0.2]: 0.4 alone misses 0.5, 0.4 plus any one 0.2 reaches it.
    mask = kept(torch.tensor([0.4, 0.2, 0.2, 0.2]).log(), 0.5)
    assert mask[0] and int(mask.sum()) == 2
    # All tied: reaching 0.3 of a uniform 4-way split takes two tokens.
    assert int(kept(torch.zeros(4), 0.3).sum()) == 2
    assert int(kept(torch.zeros(4), 0.6).sum()) == 3


@pytest.mark.parametrize("top_p", [0.3, 1e-3, 1e-9])
def test_top_p_always_keeps_the_most_likely_token(top_p: float) -> None:
    # 1e-9: 1 - top_p rounds to 1.0 in float32, so every cumulative mass is <= it.
    logits = torch.tensor([3.0, 0.0, -1.0, -2.0])  # top-1 holds ~0.93 of the mass
    mask = kept(logits, top_p)
    assert mask.tolist() == [True, False, False, False]
    if top_p < 0.25:  # tied at the top, one token already reaches top_p: still exactly one kept
        assert int(kept(torch.zeros(4), top_p).sum()) == 1


def test_top_k_keeps_exactly_k_distinct_logits() -> None:
    logits = torch.randn(8, V)
    k = torch.tensor([1, 2, 3, 5, 8, 11, V, 4])
    masked = apply_top_k_top_p(logits.clone(), k, None)
    for row in range(8):
        keep = masked[row] > float("-inf")
        assert int(keep.sum()) == int(k[row])
        assert keep[logits[row].topk(int(k[row])).indices].all()
        assert torch.equal(masked[row][keep], logits[row][keep])  # kept logits untouched


# -- seeds --------------------------------------------------------------------------


def seeded_run(seed: int, batch_size: int, row: int, others_seeded: bool, global_seed: int,
               steps: int = 8) -> list[int]:
    """Tokens of the row seeded with `seed` over `steps` steps, in a batch of `batch_size` rows."""
    torch.manual_seed(global_seed)
    gen = torch.Generator().manual_seed(seed)
    step_logits = torch.randn(steps, V, generator=torch.Generator().manual_seed(99)) * 0.5  # nearly flat
    tokens = []
    for step in range(steps):
        logits = torch.randn(batch_size, V)  # other rows' logits vary between runs
        logits[row] = step_logits[step]
        batch = batch_of(batch_size, 1.0, top_k=V - 1)
        batch.generators = {row: gen}
        if others_seeded:
            batch.generators.update({i: torch.Generator().manual_seed(1000 + i) for i in range(batch_size) if i != row})
        tokens.append(int(sample(logits, batch).token_ids[row]))
    return tokens


def test_a_seeded_row_is_the_same_alone_or_in_any_batch() -> None:
    alone = seeded_run(seed=7, batch_size=1, row=0, others_seeded=False, global_seed=1)
    assert seeded_run(7, batch_size=5, row=3, others_seeded=False, global_seed=2) == alone
    assert seeded_run(7, batch_size=4, row=0, others_seeded=True, global_seed=3) == alone
    assert seeded_run(7, batch_size=9, row=8, others_seeded=True, global_seed=4) == alone


def test_different_seeds_give_different_tokens() -> None:
    runs = {tuple(seeded_run(s, batch_size=2, row=1, others_seeded=False, global_seed=0)) for s in range(5)}
    assert len(runs) == 5


def test_unseeded_rows_vary_with_the_global_rng() -> None:
    """Control for the seed test: without a generator the row does depend on its batch's RNG."""
    logits = torch.zeros(1, V)
    draws = set()
    for s in range(10):
        torch.manual_seed(s)
        draws.add(int(sample(logits.clone(), batch_of(1, 1.0)).token_ids[0]))
    assert len(draws) > 1


# -- banned tokens (min_tokens) -----------------------------------------------------


def test_banned_tokens_are_never_sampled() -> None:
    n = 2000
    logits = torch.zeros(n, V)
    logits[:, [0, 5]] = 4.0  # the banned ids are by far the most likely
    temps = torch.where(torch.arange(n) % 4 == 0, 0.0, 1.0)
    banned_rows = list(range(0, n, 2))
    banned = [(r, [0, 5]) for r in banned_rows]

    for all_greedy, t in [(False, temps), (True, torch.zeros(n))]:
        out = sample(logits.clone(), SamplingBatch(temperature=t, all_greedy=all_greedy, banned=banned))
        got = out.token_ids[banned_rows]
        assert not torch.isin(got, torch.tensor([0, 5])).any()
        # Rows without a ban still pick the (otherwise) favourite ids.
        free = out.token_ids[1::2]
        assert torch.isin(free, torch.tensor([0, 5])).float().mean() > 0.5


# -- logprobs -----------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits() -> None:
    n = 32
    raw = torch.randn(n, V) * 2
    batch = SamplingBatch(
        temperature=torch.linspace(0.0, 2.0, n), all_greedy=False, top_k=torch.full((n,), 5),
        top_p=torch.full((n,), 0.8), min_p=torch.full((n,), 0.05), banned=[(1, [0, 1, 2])], max_logprobs=4,
    )
    out = sample(raw.clone(), batch)

    ref = raw.double().log_softmax(-1)
    expected = ref.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.sampled_logprob.double(), expected, atol=1e-5, rtol=0)
    top = ref.topk(4, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs.double(), top.values, atol=1e-5, rtol=0)


def test_logprobs_off_or_sampled_only() -> None:
    raw = torch.randn(4, V)
    out = sample(raw.clone(), SamplingBatch(temperature=torch.full((4,), 0.5), all_greedy=False))
    assert out.sampled_logprob is None and out.top_ids is None

    out = sample(raw.clone(), SamplingBatch(temperature=torch.full((4,), 0.5), all_greedy=False, max_logprobs=0))
    torch.testing.assert_close(out.sampled_logprob, raw.log_softmax(-1).gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids is None and out.top_logprobs is None


def test_top_k_alone_masks_like_the_sorted_path_ties_included() -> None:
    """Top-k without top-p takes a topk shortcut; it must keep exactly what the
    one-sort path keeps (top_p=1.0 forces that path and masks nothing more)."""
    from pdserve.workers.sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(7, 300, generator=g).round(decimals=1)  # many ties
        k = torch.randint(1, 301, (7,), generator=g)
        fast = apply_top_k_top_p(logits.clone(), k, None)
        assert torch.equal(fast, apply_top_k_top_p(logits.clone(), k, torch.ones(7)))
        assert ((fast > float("-inf")).sum(-1) >= k).all()


@pytest.mark.parametrize("u", [0.0, 1.0])
def test_a_uniform_draw_at_either_end_still_picks_an_allowed_token(u: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw inverts the CDF at u x total. u = 0 happens (a float draw of zero), and u x
    total can round up to the total: neither may pick a token of probability 0 (a row with
    one allowed token after top-k 1, min-p or bans; zeros before and after it)."""
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(u))
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.3, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    got = sampler.categorical(probs, {1: torch.Generator().manual_seed(3)}).tolist()
    assert got == [2, 3, 1, 0 if u == 0.0 else 2]


def test_the_draw_leaves_its_probabilities_unchanged() -> None:
    """sample_with_probs hands the same tensor to verification after drawing from it."""
    probs = torch.rand(3, 50, dtype=torch.float64)
    before = probs.clone()
    sampler.categorical(probs, {})
    assert torch.equal(probs, before)


def test_the_cdf_is_summed_finely_enough_for_a_long_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A heavy first token, then 4,095 tokens of 1.4 float32 ulps (at 1.0) each: a CDF kept
    in float32 rounds every boundary to an ulp, which moves the draw meant for the middle of
    tail token 1,000 to a neighbour (torch's float32 cumsum: token 1,002 for 1,001). The
    float64 sum puts it where the exact CDF does."""
    tail = 4095
    m = 1.4 * 2.0 ** -24
    probs = torch.full((1, 1 + tail), m, dtype=torch.float32)
    probs[0, 0] = 1.0 - tail * m
    p64 = probs.double()
    total = float(p64.sum())
    j = 1000
    u = (float(p64[0, 0]) + (j + 0.5) * float(p64[0, 1])) / total
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(u))
    assert sampler.categorical(probs, {}).tolist() == [1 + j]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_on_ties_nans_infs_and_views(dtype: torch.dtype) -> None:
    """The sampler's argmax (numpy's on CPU: torch's is unvectorised) picks what torch.argmax picks:
    the first of tied maxima, a NaN where a row has one, any shape, strided views."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 300, generator=g).to(dtype)
    x[0, 0, 7] = x[0, 0, 250] = 100.0  # a tie: the first wins
    x[1, 2] = float("-inf")  # a row of -inf: index 0
    x[2, 1, 40] = x[2, 1, 90] = float("nan")  # NaN counts as the largest; the first one
    x[3, 3, 299] = float("inf")
    x[4, 4, :] = 1.0  # all equal
    for view in (x, x[:, 1], x[..., ::3], x.transpose(0, 1), x[0, 0]):
        got = sampler.argmax(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1)), view.shape
