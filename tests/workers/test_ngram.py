"""Prompt-lookup drafting on hand-made sequences: which earlier occurrence is
copied (longest suffix first, then the most recent) and how much of it."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.workers.spec.ngram import NgramProposer, TokenBuffer, ngram_draft


def draft(seq: list[int], min_n: int = 1, max_n: int = 4, k: int = 3) -> list[int]:
    return ngram_draft(seq, min_n, max_n, k).tolist()


def test_no_match_gives_no_draft() -> None:
    assert draft([1, 2, 3, 4, 5]) == []
    assert draft([]) == []
    assert draft([7]) == []
    # The last token occurs earlier, but not the 2-token suffix min_n asks for.
    assert draft([1, 2, 9, 3, 2], min_n=2) == []


def test_single_token_match() -> None:
    #            0  1  2  3  4  5
    assert draft([5, 6, 7, 8, 9, 6]) == [7, 8, 9]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_match_at_each_n(n: int) -> None:
    # The suffix (the last n tokens) occurs once earlier, followed by 100, 101, 102;
    # one more token of context before it differs (0 vs 50), so the match is exactly n long.
    suffix = list(range(10, 10 + n))
    seq = [0, *suffix, 100, 101, 102, 103, 50, *suffix]
    assert draft(seq, min_n=n, max_n=n) == [100, 101, 102]
    assert draft(seq, min_n=1, max_n=4) == [100, 101, 102]
    if n < 4:
        assert draft(seq, min_n=n + 1, max_n=4) == []


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # "2 3" occurs at 1-2 (followed by 40, 41); "3" alone occurs more recently at 6 (followed by 60).
    seq = [1, 2, 3, 40, 41, 5, 3, 60, 7, 2, 3]
    assert draft(seq, max_n=4) == [40, 41, 5]
    assert draft(seq, max_n=1) == [60, 7, 2]  # n capped at 1: the most recent "3"


def test_most_recent_occurrence_wins_among_equally_long_ones() -> None:
    seq = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 30, 31, 9, 1, 2]
    assert draft(seq, min_n=2, max_n=2) == [30, 31, 9]


def test_max_n_caps_the_match_length_but_not_the_choice() -> None:
    # A 3-token match exists at 0-2; with max_n=2 any "8 9" counts, and the most recent one is at 5-6.
    seq = [7, 8, 9, 1, 1, 8, 9, 2, 2, 7, 8, 9]
    assert draft(seq, max_n=3) == [1, 1, 8]
    assert draft(seq, max_n=2) == [2, 2, 7]


def test_a_match_near_the_end_continues_the_period() -> None:
    seq = [4, 5, 6, 4, 5]
    # "4 5" recurs 3 tokens back: period 3, so after 6 4 5 come 6 4 again.
    assert draft(seq, min_n=2, k=5) == [6, 4, 5, 6, 4]
    # A run of one token: the occurrence overlaps the suffix; the run continues.
    assert draft([3, 3, 3, 3, 3], k=4) == [3, 3, 3, 3]
    assert draft([1, 2, 1, 2, 1, 2], min_n=2, max_n=4, k=5) == [1, 2, 1, 2, 1]
    assert draft([9, 1, 2, 1, 2], min_n=2, k=3) == [1, 2, 1]


def test_k_limits_the_draft() -> None:
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert draft(seq, min_n=2, k=1) == [3]
    assert draft(seq, min_n=2, k=4) == [3, 4, 5, 6]


def test_numpy_input_and_proposer() -> None:
    seq = np.array([1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int64)
    proposer = NgramProposer(min_n=2, max_n=3, k=2)
    out = proposer.propose(seq)
    assert out.dtype == np.int64 and out.tolist() == [3, 4]
    assert proposer.propose(seq, k=3).tolist() == [3, 4, 5]
    out[0] = -1  # the draft is a copy, not a view into the sequence
    assert seq[2] == 3


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(0, 3, 3), (3, 2, 3), (1, 3, 0), (-1, -1, 1)])
def test_bad_parameters_raise(min_n: int, max_n: int, k: int) -> None:
    with pytest.raises(ValueError):
        ngram_draft([1, 2, 3], min_n, max_n, k)
    with pytest.raises(ValueError):
        NgramProposer(min_n, max_n, k)


def test_agrees_with_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 4, rng.integers(0, 40)).tolist()
        min_n, max_n = sorted(rng.integers(1, 5, 2).tolist())
        assert draft(seq, min_n, max_n, k=3) == brute_force(seq, min_n, max_n, 3)


def brute_force(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[len(seq) - n :]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                period = seq[start + n :]  # what followed, repeated if shorter than k
                return [period[i % len(period)] for i in range(k)]
    return []


def test_token_buffer_mirrors_a_growing_list() -> None:
    buf, seq = TokenBuffer(), list(range(5))
    assert buf.sync(seq).tolist() == seq
    seq += list(range(5, 700))  # grows past the initial capacity
    assert buf.sync(seq).tolist() == seq
    seq.append(3)
    assert buf.sync(seq).tolist() == seq and buf.sync(seq).dtype == np.int64
    with pytest.raises(ValueError, match="shrank"):
        buf.sync(seq[:10])
