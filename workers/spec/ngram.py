"""Prompt-lookup (n-gram) drafting: guess the next tokens by finding the
sequence's own tail earlier in the sequence and copying what followed it.

It runs on the CPU for every speculating sequence at every decode step, so it
is a few numpy ops on the candidate positions rather than a Python loop over
the sequence: one O(L) comparison against the last token, then at most
`max_n - 1` comparisons over the (usually few) positions that survived
(microseconds per sequence: docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.workers.request import Request
from pdserve.workers.spec.proposer import Drafts

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class NgramProposer:
    """Drafts up to `k` tokens by matching the longest suffix of length
    `min_n..max_n` (vLLM's prompt_lookup_min / prompt_lookup_max)."""

    min_n: int = 1
    max_n: int = 4
    k: int = 5

    def __post_init__(self) -> None:
        _check(self.min_n, self.max_n, self.k)

    def propose(self, token_ids: np.ndarray | Sequence[int], k: int | None = None) -> np.ndarray:
        """Draft for one sequence; `k` overrides the configured draft length
        (e.g. shrunk when the batch is large). See `ngram_draft`."""
        return ngram_draft(token_ids, self.min_n, self.max_n, self.k if k is None else k)

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        """`Proposer.draft`: each request's lookup over its own tokens (deterministic drafts)."""
        return [self.propose(_token_array(r), k).tolist() for r, k in zip(requests, ks)], [None] * len(requests)

    def retain(self, request_ids: set[str]) -> None:
        """Nothing to free: the lookup's only state (a token mirror) lives on the request."""


def ngram_draft(token_ids: np.ndarray | Sequence[int], min_n: int, max_n: int, k: int) -> np.ndarray:
    """The tokens that followed the most recent earlier occurrence of the
    longest suffix of `token_ids` whose length n is in [min_n, max_n].

    token_ids: the whole sequence, prompt + output so far. An int64 numpy array
        is used as is; a list is converted first, which for 2k tokens costs
        ~40 us, more than the search (~3-20 us), so keep a numpy copy.
    Returns int64 [k], or empty when no suffix of length >= min_n occurs
    earlier. When the occurrence sits d < k tokens before the end (it may
    overlap the suffix itself, as in a run of one token), the d tokens after it
    are repeated: a sequence whose last n tokens recur d tokens back is, as far
    as the evidence goes, periodic with period d. (Stopping at the end of the
    sequence instead drafts one token per step in a loop of one token, which is
    exactly where drafting should pay most.)
    Raises ValueError if min_n < 1, max_n < min_n or k < 1.
    """
    _check(min_n, max_n, k)
    tokens = np.asarray(token_ids, dtype=np.int64)
    last = len(tokens) - 1
    if last < min_n:  # a suffix of length min_n needs min_n earlier tokens too
        return _EMPTY
    # ends[i]: end positions j < last where tokens[j-n+1 .. j] == tokens[last-n+1 .. last]
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    n = 1
    while n < max_n and len(ends):
        ends_longer = ends[ends >= n]
        ends_longer = ends_longer[tokens[ends_longer - n] == tokens[last - n]]
        if not len(ends_longer):
            break
        ends, n = ends_longer, n + 1
    if n < min_n or not len(ends):
        return _EMPTY
    start = int(ends[-1]) + 1  # ends is ascending: the last one is the most recent
    if last + 1 - start >= k:
        return np.array(tokens[start : start + k])
    return np.resize(tokens[start:], k)  # repeats the period (a new array)


class TokenBuffer:
    """An int64 numpy mirror of a growing token list, extended by its new tail
    only: converting a 2k-token list every step costs more than the search."""

    __slots__ = ("_array", "_len")

    def __init__(self) -> None:
        self._array = np.zeros(256, dtype=np.int64)
        self._len = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The array of `token_ids` (a view, valid until the next call). The
        list must only have grown since the last call (tokens are appended,
        never rewritten)."""
        n = len(token_ids)
        if n < self._len:
            raise ValueError(f"token list shrank from {self._len} to {n}")
        if n > len(self._array):
            grown = np.zeros(max(n, 2 * len(self._array)), dtype=np.int64)
            grown[: self._len] = self._array[: self._len]
            self._array = grown
        if n > self._len:
            self._array[self._len : n] = token_ids[self._len : n]
            self._len = n
        return self._array[:n]


def _check(min_n: int, max_n: int, k: int) -> None:
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def _token_array(req: Request) -> np.ndarray:
    """The request's tokens as int64, for the lookup (kept incrementally)."""
    if req.token_buffer is None:
        req.token_buffer = TokenBuffer()
    return req.token_buffer.sync(req.all_token_ids)
