"""What the engine returns for a request (the shape vLLM users know)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability as vLLM's offline API gives it (`LLM.generate`): `.logprob`,
    `.rank` (1: the most likely; None where it is not known: a sampled token outside the top N
    asked for) and `.decoded_token`. A float too: arithmetic and comparisons use the number, so
    code written for plain floats reads it unchanged."""

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        return Logprob, (float(self), self.rank, self.decoded_token)


def ranked(entry: dict[int, float], chosen: int, top_n: int, decode: Callable[[int], str]) -> dict[int, float]:
    """An entry ({token id: log-prob}: the top `top_n`, and `chosen` if it is not among them) as
    vLLM's Logprobs: ranks 1.. by log-prob for the top N; `chosen` outside them has no known rank.
    (Typed as floats, which they are: the outputs' field holds either.)"""
    outside = len(entry) > top_n and chosen in entry
    order = sorted((t for t in entry if not (outside and t == chosen)), key=lambda t: -entry[t])
    ranks: dict[int, int | None] = {t: i + 1 for i, t in enumerate(order)}
    if outside:
        ranks[chosen] = None
    return {t: Logprob(lp, ranks.get(t), decode(t)) for t, lp in entry.items()}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per generated token: {token id: log-prob} with the top-N and the sampled one (`LLM.generate`
    # gives Logprob values, floats with vLLM's rank and decoded_token).
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, {token id: log-prob} (None for the
    # first). In every cumulative output; in the first of a DELTA stream only, or, over
    # the token stream, in consecutive slices in its first outputs (concatenate them).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set (with finished and finish_reason "abort") when the engine failed this request
    # alone: its values or logits broke its row of a step (workers/row_faults.py).
    error: str | None = None
    error_refused: bool = False  # the error is the request's own input's (a ValueError, not a fault)


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One DELTA output equivalent to `a` followed by `b` (same request, one sample)."""
    ca, cb = a.outputs[0], b.outputs[0]
    logprobs = None if ca.logprobs is None and cb.logprobs is None else (ca.logprobs or []) + (cb.logprobs or [])
    merged = CompletionOutput(ca.index, ca.text + cb.text, ca.token_ids + cb.token_ids, cb.cumulative_logprob,
                              logprobs, cb.finish_reason, cb.stop_reason)
    prompt_lp = None if a.prompt_logprobs is None and b.prompt_logprobs is None else (
        (a.prompt_logprobs or []) + (b.prompt_logprobs or []))  # a stream may carry them in slices
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, [merged], b.finished, b.num_cached_tokens,
                         b.metrics, prompt_lp)
