"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Everything is a tensor op over the batch except seeded rows, which each draw
their noise from their own generator: that is what makes a seeded request's
tokens independent of whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the model runner."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy row
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where disabled; None if no row filters
    top_p: torch.Tensor | None = None  # [N] float32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [N] float32, 0.0 where disabled
    generators: dict[int, torch.Generator] | None = None  # row -> generator, seeded rows only
    banned: list[tuple[int, list[int]]] | None = None  # (row, token ids) forbidden this step (min_tokens)
    max_logprobs: int = -1  # >= 0: also return the top-N raw log-probs of every row


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    sampled_logprob: torch.Tensor | None = None  # [N] raw log-prob of the sampled token
    top_ids: torch.Tensor | None = None  # [N, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [N, max_logprobs]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [N, V] float32 (modified in place)."""
    raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
    if batch.banned:
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_random(logits, batch)
    out = SamplerOutput(token_ids=tokens)
    if raw_logprobs is not None:
        out.sampled_logprob = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        if batch.max_logprobs > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
    return out


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy_rows = batch.temperature == 0.0
    greedy_tokens = logits.argmax(dim=-1)
    temperature = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits.div_(temperature[:, None])
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = logits.softmax(dim=-1)
    if batch.min_p is not None:
        threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill_(probs < threshold, 0.0)
    random_tokens = exponential_race(probs, batch.generators or {})
    return torch.where(greedy_rows, greedy_tokens, random_tokens)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus top-p; one sort for both."""
    vocab = logits.shape[-1]
    if top_p is None and top_k is not None:
        # Top-k alone needs only each row's k-th largest value: topk, not a sort
        # of the vocabulary (ties with the k-th value are kept, as below).
        k = top_k.clamp(1, vocab)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        return logits.masked_fill_(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(-1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample each row of `probs` as argmax(p / E), E ~ Exp(1): the same law as a
    categorical draw, with no cumsum and no normalisation."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def advance_generator(generator: torch.Generator, vocab_size: int, device: torch.device) -> None:
    """Consume exactly the draws `exponential_race` makes for one seeded row, as if
    this generator had sampled a token here (it did, on another worker)."""
    torch.empty(vocab_size, device=device).exponential_(generator=generator)
