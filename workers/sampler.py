"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, seeds, logprobs,
presence/frequency/repetition penalties and logit bias.

Everything is a tensor op over the batch except seeded rows, which each draw
their noise from their own generator: that is what makes a seeded request's
tokens independent of whatever else shares its batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.workers.buffers import small_tensor, to_device_async
from pdserve.workers.grammar import GrammarState, allocate_bitmask, apply_bitmask
from pdserve.workers.sampling_params import GOLDEN, mix64


@dataclass
class Penalties:
    """Per-row penalty settings and token histories of one step (rows without
    penalties carry neutral values: 0, 0, 1)."""

    presence: torch.Tensor  # [N, 1] float32
    frequency: torch.Tensor  # [N, 1] float32
    repetition: torch.Tensor  # [N, 1] float32
    output_counts: torch.Tensor  # [N, V] float32: times each token was generated so far
    seen: torch.Tensor | None  # [N, V] bool: in the prompt or the output; None when no row has a repetition penalty

    @classmethod
    def build(cls, rows: list[tuple[list[int], list[int], float, float, float]], vocab_size: int,
              device: torch.device) -> Penalties:
        """rows: (prompt ids, output ids, presence, frequency, repetition) per sampled row."""
        n = len(rows)

        def column(values: list[float]) -> torch.Tensor:
            return small_tensor(values, torch.float32, device)[:, None]

        # Only the rows that have a penalty count their tokens: a row without one comes out
        # neutral whatever its counts (x 0, or a factor of 1), and counting every row's prompt
        # made one penalized request cost the whole batch its longest prompt, every step.
        counts = _bincount_rows([r[1] if r[2] or r[3] or r[4] != 1.0 else [] for r in rows], vocab_size, device)
        seen = None
        if any(r[4] != 1.0 for r in rows):
            prompts = _bincount_rows([r[0] if r[4] != 1.0 else [] for r in rows], vocab_size, device)
            seen = (counts > 0) | (prompts > 0)
        assert counts.shape == (n, vocab_size)
        return cls(column([r[2] for r in rows]), column([r[3] for r in rows]), column([r[4] for r in rows]), counts,
                   seen)


def _bincount_rows(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32 counts of each row's tokens (one scatter over the rows that have any,
    padded with a spare column: empty rows cost nothing, whatever the longest row)."""
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.float32, device=device)
    rows = [i for i, t in enumerate(token_lists) if t]
    if rows:
        width = max(len(token_lists[i]) for i in rows)
        padded = torch.full((len(rows), width), vocab_size, dtype=torch.int64)
        for j, i in enumerate(rows):
            padded[j, : len(token_lists[i])] = torch.as_tensor(token_lists[i], dtype=torch.int64)
        padded = to_device_async(padded, device)
        ones = torch.ones_like(padded, dtype=torch.float32)
        if len(rows) == len(token_lists):
            counts.scatter_add_(1, padded, ones)
        else:
            which = to_device_async(torch.tensor(rows, dtype=torch.int64), device)[:, None].expand_as(padded)
            counts.index_put_((which, padded), ones, accumulate=True)
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """vLLM's order and definitions, in place: repetition (prompt and output tokens:
    positive logits divided, negative multiplied), then frequency (x count) and
    presence (x once) over the output tokens, OpenAI's definition."""
    if pen.seen is not None:
        factor = torch.where(pen.seen, pen.repetition, torch.ones_like(pen.repetition))
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits.sub_(pen.frequency * pen.output_counts)
    logits.sub_(pen.presence * (pen.output_counts > 0).to(logits.dtype))
    return logits


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the model runner."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy row
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where disabled; None if no row filters
    top_k_max: int | None = None  # max(top_k), known on the host (None: read from the device, a sync)
    top_p: torch.Tensor | None = None  # [N] float32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [N] float32, 0.0 where disabled
    generators: dict[int, torch.Generator] | None = None  # row -> generator, seeded rows only
    # (row, token ids): the only tokens the row may take (allowed_token_ids)
    allowed: list[tuple[int, torch.Tensor]] | None = None
    banned: list[tuple[int, list[int]]] | None = None  # (row, token ids) forbidden this step (min_tokens, bad_words)
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None  # (row, token ids, biases)
    penalties: Penalties | None = None
    # [N, ceil(V / 32)] int32: the tokens each row's grammar allows (workers/grammar.py); None: no row has one
    token_bitmask: torch.Tensor | None = None
    # Greedy rows whose grammar checks the pick rather than masking ahead (row, grammar; CPU):
    # the grammar accepts the token it allows (see `_check_picks`)
    check_first: list[tuple[int, GrammarState]] | None = None
    check_s: float = 0.0  # set by `sample`: seconds the check_first rows' grammars took
    max_logprobs: int = -1  # >= 0: also return the top-N raw log-probs of every row
    any_greedy: bool = True  # some row has temperature 0 (False: no greedy argmax to take, known on the host)


# A row's token when its row had no valid one (see `checked`): the engine fails that request alone.
NO_TOKEN = -1


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64; NO_TOKEN where a row had no valid token
    sampled_logprob: torch.Tensor | None = None  # [N] raw log-prob of the sampled token
    top_ids: torch.Tensor | None = None  # [N, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [N, max_logprobs]


# numpy's argmax is vectorised; torch's CPU one is not: 14-19x slower over a step's logits at
# 4096 and 49152 tokens (`python bench/experiments/argmax_cpu.py`, docs/performance.md).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value along the last dimension (int64): the first one
    on ties and a NaN where a row has one, as torch.argmax gives."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1), dtype=np.int64))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [N, V] float32 (modified in place)."""
    raw_logprobs = logits.log_softmax(dim=-1) if batch.max_logprobs >= 0 else None
    apply_logits_processors(logits, batch)
    if batch.all_greedy:
        tokens = argmax(logits)
    else:
        tokens = _sample_random(logits, batch)
    if batch.check_first:
        start = time.perf_counter()
        tokens = _check_picks(logits, tokens, batch.check_first)
        batch.check_s = time.perf_counter() - start
    tokens, safe = checked(tokens, logits)
    out = SamplerOutput(token_ids=tokens)
    if raw_logprobs is not None:
        out.sampled_logprob = raw_logprobs.gather(1, safe[:, None])[:, 0]
        if batch.max_logprobs > 0:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
    return out


def _check_picks(logits: torch.Tensor, tokens: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> torch.Tensor:
    """Greedy rows checked by their grammar after the pick (llama.cpp's order): a pick it
    allows it accepts; a row whose pick it refuses is masked (after every other processor,
    as ahead) and picked again. The same token as masking first: the unmasked argmax, when
    allowed, is the masked one too, ties and NaNs included (the first such index). A row
    with nothing allowed left finite is refused by `checked` and failed alone."""
    picks = tokens.tolist()
    refused = [(row, grammar) for row, grammar in rows if not grammar.take(picks[row])]
    if not refused:
        return tokens
    mask = allocate_bitmask(len(refused), logits.shape[-1])
    for i, (_, grammar) in enumerate(refused):
        grammar.fill(mask, i)
    at = [row for row, _ in refused]
    masked = logits[at]
    apply_bitmask(masked, mask)
    logits[at] = masked
    for (row, grammar), pick in zip(refused, argmax(masked).tolist()):
        picks[row] = pick
        grammar.take(pick)  # refused only where nothing allowed is finite: `checked` fails the row
    return torch.tensor(picks, dtype=torch.int64)


def checked(tokens: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` with NO_TOKEN where a row's pick is not a real choice, and the same ids
    clamped into the vocabulary (safe to index with). Not a real choice: an id outside
    the vocabulary (what a draw from a NaN distribution gives) or one whose (processed)
    logit is not finite (a row that was all -inf, NaN or overflowed). One gather and
    two elementwise ops over [N], no host sync: a request whose values or logits break
    its row is failed alone by the engine, not by an index error in the next step."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES and not logits.requires_grad:
        # numpy: ~17 us at batch 8 against ~60 us for the same five torch ops (their dispatch).
        t = tokens.numpy()
        safe_np = np.clip(t, 0, vocab - 1)
        ok_np = (t == safe_np) & np.isfinite(logits.numpy()[np.arange(len(t)), safe_np])
        return torch.from_numpy(np.where(ok_np, t, NO_TOKEN)), torch.from_numpy(safe_np)
    safe = tokens.clamp(0, vocab - 1)
    bad = (tokens != safe) | ~torch.isfinite(logits.gather(1, safe[:, None])[:, 0])
    return tokens.masked_fill(bad, NO_TOKEN), safe


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """What acts on the logits before the sampling distribution (vLLM's order): the allowed
    tokens, min_tokens' and bad words' bans, logit bias, penalties, then the grammar's mask
    last, so that nothing after it can give a refused token a finite logit. In place; greedy
    rows included."""
    if batch.allowed:
        for row, only in batch.allowed:
            keep = logits[row, only]
            logits[row] = float("-inf")
            logits[row, only] = keep
    if batch.banned:
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
    if batch.logit_bias:
        for row, bias_ids, bias in batch.logit_bias:
            logits[row, bias_ids] += bias
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties)
    if batch.token_bitmask is not None:
        apply_bitmask(logits, batch.token_bitmask)
    return logits


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy_tokens = argmax(logits) if batch.any_greedy else None  # before sampling_probs scales them
    probs = sampling_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.top_k_max)
    random_tokens = categorical(probs, batch.generators or {})
    if greedy_tokens is None:
        return random_tokens
    return torch.where(batch.temperature == 0.0, greedy_tokens, random_tokens)


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                   top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                   top_k_max: int | None = None) -> torch.Tensor:
    """The distribution a random row samples from, per row: temperature (0 rows: as 1),
    then top-k and top-p, softmax, then min-p. Unnormalised after min-p (the draw
    needs no normalisation). `logits` is modified in place."""
    temperature = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    logits = logits.div_(temperature[:, None])
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p, top_k_max)
    probs = logits.softmax(dim=-1)
    if min_p is not None:
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill_(probs < threshold, 0.0)
    return probs


def sample_with_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample`, also returning the normalised distribution each random row's token was
    drawn from ([N, V]; None when every row is greedy; greedy rows' rows are
    meaningless): what a speculative draft must hand to verification. No
    logprobs (`max_logprobs` is ignored)."""
    apply_logits_processors(logits, batch)
    greedy_tokens = argmax(logits)
    if batch.all_greedy:
        return checked(greedy_tokens, logits)[0], None
    probs = sampling_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.top_k_max)
    probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    random_tokens = categorical(probs, batch.generators or {})
    return checked(torch.where(batch.temperature == 0.0, greedy_tokens, random_tokens), logits)[0], probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      top_k_max: int | None = None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus top-p; one sort for both.
    `top_k_max`: max(top_k) if the caller knows it (saves reading it from the device)."""
    vocab = logits.shape[-1]
    if top_p is None and top_k is not None:
        # Top-k alone needs only each row's k-th largest value: topk, not a sort
        # of the vocabulary (ties with the k-th value are kept, as below).
        k = top_k.clamp(1, vocab)
        width = min(vocab, max(1, top_k_max)) if top_k_max is not None else int(k.max())
        kth = logits.topk(width, dim=-1).values.gather(1, (k - 1)[:, None])
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


def categorical(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` ([N, V], non-negative, unnormalised), drawn by inverting
    the row's CDF with one uniform: the first token whose cumulative mass exceeds u x total.

    Why not an exponential race (argmax(p / E), E ~ Exp(1)): it draws V random numbers a row,
    and on a CPU drawing them is most of the sampler (8 x 49,152 floats: ~1 ms to fill, ~2 ms
    the race, against ~0.2 ms for this, 2 threads; a SmolLM2 decode step at batch 8 in
    bfloat16 is ~34 ms). The sum runs in float64, so a token's share of the interval is off
    by at most one float64 rounding (~1e-16 of the row's mass). u x total can round up to the
    total (u is below 1 but the product is rounded), and no token's cumulative mass then
    exceeds it: the index is capped at the row's last token with mass, never a token of
    probability 0. A seeded row draws its u from its own generator."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # a new tensor: `probs` stays as it is
    total = cdf[:, -1:].contiguous()
    u = torch.empty(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    if len(generators) < probs.shape[0]:
        u.uniform_()
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    picked = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the first index holding the whole mass
    return torch.minimum(picked, last)[:, 0]


def seeded_at(generator: torch.Generator, seed: int | None, position: int) -> torch.Generator:
    """`generator`, reseeded for a request's output `position`: a seeded request's
    draws at each position depend on its seed and that position only, not on how
    many draws came before. So its tokens are the same wherever each was sampled
    (the prefill worker samples the first, a decode worker the rest; a migrated
    request goes on on another worker; a preempted one recomputes)."""
    generator.manual_seed(mix64((seed or 0) * GOLDEN + position) & _SEED_MASK)
    return generator


_SEED_MASK = (1 << 63) - 1
