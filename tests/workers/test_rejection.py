"""Verification of drafts against oracles: greedy rows by hand, and sampled
rows by the law of what they emit.

The law check runs speculative decoding on a small Markov chain (the target's
next-token law depends on the previous token) and compares the joint law of
the first three emitted tokens with exact, one-token-at-a-time sampling
computed in float64. The same harness must catch deliberately broken
verifiers (negative controls), which shows the bound is tight enough to see
the classic mistakes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pdserve.workers.sampler import SamplingBatch, sample
from pdserve.workers.spec import rejection
from pdserve.workers.spec.rejection import pad_drafts, unflatten_logits, verify

V = 6
K_MAX = 3  # drafts per step, drawn per row and step from 0..K_MAX (ragged batches)
M = 3  # emitted tokens whose joint law is checked: V**M outcomes
N = 30_000  # sequences per law check
DELTA = 1e-6


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def batch_of(n: int, temperature: float | torch.Tensor, **filters: float) -> SamplingBatch:
    """n rows with one temperature (or per-row ones) and the same filters (top_k, top_p, min_p)."""
    temps = temperature if isinstance(temperature, torch.Tensor) else torch.full((n,), float(temperature))
    batch = SamplingBatch(temperature=temps, all_greedy=not bool(temps.any()))
    for name, value in filters.items():
        setattr(batch, name, torch.full((n,), value, dtype=torch.int64 if name == "top_k" else torch.float32))
    return batch


# -- greedy -------------------------------------------------------------------------


def test_greedy_by_hand() -> None:
    argmax = [[1, 2, 3, 4], [5, 0, 1, 2], [3, 3, 3, 3], [0, 4, 2, 1], [2, 2, 2, 2]]  # target argmax per (row, position)
    logits = torch.full((5, 4, V), -1.0).scatter_(2, torch.tensor(argmax)[..., None], 2.0)
    drafts = torch.tensor([
        [1, 2, 3],  # all accepted: + the bonus token
        [4, 0, 1],  # first rejected: the target's token alone
        [3, 5, 3],  # second rejected (the third would have matched)
        [0, -1, 99],  # one draft, padded with junk
        [7, 7, 7],  # no drafts: plain greedy
    ])
    out = verify(logits, drafts, [3, 3, 3, 1, 0], batch_of(5, 0.0))
    assert out.token_ids == [[1, 2, 3, 4], [5], [3, 3], [0, 4], [2]]
    assert out.num_accepted == [3, 0, 1, 1, 0]


def test_greedy_rows_keep_the_greedy_rule_in_a_mixed_batch() -> None:
    logits = torch.randn(64, K_MAX + 1, V) * 3
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(64, K_MAX) < 0.7, argmax[:, :-1], torch.randint(0, V, (64, K_MAX)))
    num_drafts = torch.randint(0, K_MAX + 1, (64,)).tolist()
    want = verify(logits.clone(), drafts, num_drafts, batch_of(64, 0.0))
    temps = torch.where(torch.arange(64) % 2 == 0, 0.0, 5.0)
    for _ in range(5):
        got = verify(logits.clone(), drafts, num_drafts, batch_of(64, temps, top_p=0.99), torch.rand(64, K_MAX, V))
        assert got.token_ids[::2] == want.token_ids[::2] and got.num_accepted[::2] == want.num_accepted[::2]
    assert got.token_ids[1::2] != want.token_ids[1::2]  # and the T=5 rows really sampled


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_top_k_1_equals_greedy_row_by_row(with_draft_probs: bool) -> None:
    """Rows alternate top_k=1 and no filter at T=2: the settings reach every
    position of their own row, and no other."""
    rows = 40
    logits = torch.randn(rows, K_MAX + 1, V) * 2
    drafts = torch.where(torch.rand(rows, K_MAX) < 0.8, logits.argmax(-1)[:, :-1], torch.randint(0, V, (rows, K_MAX)))
    num_drafts = [K_MAX] * rows
    want = verify(logits.clone(), drafts, num_drafts, batch_of(rows, 0.0))
    batch = batch_of(rows, 2.0)
    batch.top_k = torch.where(torch.arange(rows) % 2 == 0, 1, V)
    draft_probs = torch.rand(rows, K_MAX, V).softmax(-1) if with_draft_probs else None
    got = verify(logits.clone(), drafts, num_drafts, batch, draft_probs)
    assert got.token_ids[::2] == want.token_ids[::2]
    assert sum(want.num_accepted) > rows  # drafts were accepted, not only rejected


# -- plain sampling (no drafts) and seeds ----------------------------------------------


def mixed_batch(rows: int, seeds: dict[int, int]) -> SamplingBatch:
    """Every kind of row: greedy, temperatures, top-k, top-p, min-p, banned tokens, seeded rows."""
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0] * (rows // 4))
    batch = SamplingBatch(temperature=temps, all_greedy=False)
    batch.top_k = torch.tensor([V, 3, V, 4] * (rows // 4))
    batch.top_p = torch.tensor([1.0, 1.0, 0.8, 0.9] * (rows // 4))
    batch.min_p = torch.tensor([0.0, 0.1, 0.0, 0.05] * (rows // 4))
    batch.banned = [(1, [0, 2]), (6, [5])]
    batch.generators = {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}
    return batch


def test_no_drafts_samples_exactly_as_the_sampler() -> None:
    """k = 0 makes the sampler's draws, seeded or not: the very same tokens."""
    rows, seeds = 16, {1: 11, 2: 12, 7: 17}
    logits = torch.randn(rows, V) * 2
    for step in range(20):
        torch.manual_seed(step)
        want = sample(logits.clone(), mixed_batch(rows, seeds)).token_ids.tolist()
        torch.manual_seed(step)
        got = verify(logits.clone()[:, None], torch.zeros(rows, 0, dtype=torch.int64), [0] * rows,
                     mixed_batch(rows, seeds))
        assert got.token_ids == [[t] for t in want]
        assert got.num_accepted == [0] * rows


def test_seeded_rows_repeat_and_do_not_depend_on_the_batch() -> None:
    rows, seeds = 16, {1: 11, 3: 13, 6: 16}
    logits = torch.randn(rows, K_MAX + 1, V)
    drafts = torch.randint(0, V, (rows, K_MAX))
    draft_probs = torch.rand(rows, K_MAX, V).softmax(-1)
    num_drafts = [K_MAX, 1, 0, 2] * (rows // 4)
    first = verify(logits.clone(), drafts, num_drafts, mixed_batch(rows, seeds), draft_probs)
    again = verify(logits.clone(), drafts, num_drafts, mixed_batch(rows, seeds), draft_probs)
    assert [first.token_ids[r] for r in seeds] == [again.token_ids[r] for r in seeds]

    # Row 3 again, alone, with other padding: its draws come from its seed only.
    k = num_drafts[3]
    alone_batch = SamplingBatch(temperature=torch.tensor([2.0]), all_greedy=False, top_k=torch.tensor([4]),
                                top_p=torch.tensor([0.9]), min_p=torch.tensor([0.05]),
                                generators={0: torch.Generator().manual_seed(13)})
    alone = verify(logits[3:4, : k + 1].clone(), drafts[3:4, :k], [k], alone_batch, draft_probs[3:4, :k])
    assert alone.token_ids == [first.token_ids[3]]

    # Different seeds do give different tokens somewhere (the seeds are used at all).
    other = [verify(logits.clone(), drafts, num_drafts, mixed_batch(rows, {1: s, 3: s, 6: s}), draft_probs).token_ids
             for s in range(5)]
    assert any(o != other[0] for o in other)


# -- the law of the emitted tokens -----------------------------------------------------

# The chain: TARGET[s] are the target's logits for the token after s; DRAFT_LAW[s]
# is a draft model's law after s, far enough from the target that about half
# its drafts are rejected; ONE_HOT[s] is a deterministic drafter's guess.
_chain = torch.Generator().manual_seed(5)
TARGET = torch.randn(V, V, generator=_chain) * 1.5
DRAFT_LAW = (torch.randn(V, V, generator=_chain) * 1.5).softmax(-1)
ONE_HOT = TARGET.argsort(-1, descending=True)[:, 1]  # the target's second choice: often right, often not

Verifier = Callable[..., rejection.Verified]


def reference_law(temperature: float, top_k: int = V, min_p: float = 0.0) -> torch.Tensor:
    """[V, V] float64: the next-token law after each token, sampled one at a time.
    Top-k and min-p keep a token by comparing it with others, so neither cares
    whether the probabilities are normalised yet."""
    probs = (TARGET.double() / temperature).softmax(-1)
    probs = torch.where(probs >= probs.topk(top_k, -1).values[:, -1:], probs, 0.0)
    probs = torch.where(probs >= min_p * probs.amax(-1, keepdim=True), probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def exact_joint(law: torch.Tensor) -> torch.Tensor:
    """[V**3]: P(a, b, c) = P(a | 0) P(b | a) P(c | b), starting after token 0."""
    return torch.einsum("a,ab,bc->abc", law[0], law, law).flatten()


def speculative_joint(n: int, drafter: str, settings: dict[str, float], verifier: Verifier = verify) -> torch.Tensor:
    """Empirical [V**3] law of the first M tokens that speculative decoding emits after token 0."""
    out: list[list[int]] = [[] for _ in range(n)]
    last = [0] * n
    while active := [i for i in range(n) if len(out[i]) < M]:
        state = torch.tensor([last[i] for i in active])
        drafts, draft_probs = draft(state, drafter)
        num_drafts = torch.randint(0, K_MAX + 1, (len(active),))
        logits = TARGET[torch.cat([state[:, None], drafts], 1)]  # [b, K+1, V]: position j follows drafts[:, :j]
        padding = torch.arange(K_MAX + 1) > num_drafts[:, None]
        logits[padding] = float("nan")  # what lies past a row's drafts must not be read
        drafts[padding[:, 1:]] = -1
        if draft_probs is not None:
            draft_probs[padding[:, 1:]] = float("nan")
        temperature = settings.get("temperature", 1.0)
        filters = {name: value for name, value in settings.items() if name != "temperature"}
        result = verifier(logits, drafts, num_drafts.tolist(), batch_of(len(active), temperature, **filters),
                          draft_probs)
        for i, tokens in zip(active, result.token_ids):
            out[i].extend(tokens)
            last[i] = tokens[-1]
    outcomes = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in out])
    return torch.bincount(outcomes, minlength=V**M).double() / n


def draft(state: torch.Tensor, drafter: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, K_MAX] drafts chained from `state`, and the laws they were drawn from (None when one-hot)."""
    tokens, laws, prev = [], [], state
    for _ in range(K_MAX):
        if drafter == "sampled":
            laws.append(DRAFT_LAW[prev])
            prev = (torch.rand(len(prev), 1) > laws[-1].cumsum(-1)).sum(-1).clamp(max=V - 1)  # inverse CDF
        else:
            prev = ONE_HOT[prev]
        tokens.append(prev)
    return torch.stack(tokens, 1), torch.stack(laws, 1) if laws else None


def tv_bound(n: int, outcomes: int = V**M) -> float:
    """TV between an exact law and n draws from it stays below this except with
    probability DELTA: E[TV] <= sqrt(outcomes / n) / 2 (Cauchy-Schwarz over the
    outcomes), and one draw moves TV by at most 1/n, so McDiarmid gives
    P(TV > E[TV] + t) <= exp(-2 n t^2). For n = 30k, 216 outcomes: 0.058; an exact
    verifier measures ~0.015 here, the broken ones below 0.14 to 0.6."""
    return 0.5 * math.sqrt(outcomes / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


LAW_CASES = [
    pytest.param("sampled", {}, id="draft-model"),
    pytest.param("one-hot", {}, id="one-hot"),
    pytest.param("sampled", {"temperature": 0.7, "top_k": 4, "min_p": 0.1}, id="draft-model-T0.7-topk4-minp"),
    pytest.param("one-hot", {"temperature": 1.5, "top_k": 3}, id="one-hot-T1.5-topk3"),
]


@pytest.mark.parametrize(("drafter", "settings"), LAW_CASES)
def test_emitted_tokens_follow_the_target_law(drafter: str, settings: dict[str, float]) -> None:
    law = reference_law(settings.get("temperature", 1.0), int(settings.get("top_k", V)), settings.get("min_p", 0.0))
    got = speculative_joint(N, drafter, settings)
    assert tv(got, exact_joint(law)) < tv_bound(N)


def always_accept(*args: object) -> rejection.Verified:
    """Broken: every draft the target does not rule out is kept (u = 0)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rejection, "_uniforms", lambda num_drafts, k, gens, device: torch.zeros(len(num_drafts), k))
        return verify(*args)


def resample_from_p(*args: object) -> rejection.Verified:
    """Broken: after a rejection the token is drawn from p, not from max(0, p - q)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rejection, "_residual", lambda p, *rest: p)
        return verify(*args)


@pytest.mark.parametrize(("drafter", "verifier"), [
    pytest.param("sampled", always_accept, id="draft-model-always-accept"),
    pytest.param("sampled", resample_from_p, id="draft-model-resample-from-p"),
    pytest.param("one-hot", resample_from_p, id="one-hot-resample-from-p"),
])
def test_negative_control_biased_verifiers_fail_the_same_bound(drafter: str, verifier: Verifier) -> None:
    got = speculative_joint(N, drafter, {}, verifier)
    assert tv(got, exact_joint(reference_law(1.0))) > tv_bound(N)


# -- layout helpers and errors ---------------------------------------------------------


def test_pad_and_unflatten_build_the_padded_layout() -> None:
    drafts, num_drafts = pad_drafts([[4, 5], [], [1, 2, 3]])
    assert drafts.tolist() == [[4, 5, 0], [0, 0, 0], [1, 2, 3]] and num_drafts == [2, 0, 3]
    flat = torch.arange(9.0)[:, None].expand(9, V)  # rows 0-2, 3, 4-7 belong to the three sequences
    padded = unflatten_logits(flat, num_drafts)
    assert padded[:, :, 0].tolist() == [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]


def test_bad_shapes_raise() -> None:
    logits, drafts, batch = torch.zeros(2, 3, V), torch.zeros(2, 2, dtype=torch.int64), batch_of(2, 0.0)
    with pytest.raises(ValueError):
        verify(logits[0], drafts, [1, 1], batch)
    with pytest.raises(ValueError):
        verify(logits, drafts[:, :1], [1, 1], batch)
    with pytest.raises(ValueError):
        verify(logits, drafts, [1, 3], batch)
    with pytest.raises(ValueError):
        verify(logits, drafts, [1], batch)
    with pytest.raises(ValueError):
        verify(logits, drafts, [1, 1], batch, torch.zeros(2, 2, V + 1))
