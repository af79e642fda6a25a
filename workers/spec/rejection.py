"""Verification of drafted tokens (Leviathan et al. 2023, Chen et al. 2023):
one target pass scores every draft, and the tokens emitted are distributed
exactly as if the target had sampled them one at a time.

Per row b with drafts x_1..x_k (k = num_drafts[b], 0 allowed) and target distributions
p_1..p_{k+1} (the row's temperature/top-k/top-p/min-p applied, as sampler.py does):
  - greedy rows (temperature 0): accept x_i while x_i == argmax p_i;
  - random rows: accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
then emit one more token: at the first rejection i, one drawn from
norm(max(0, p_i - q_i)) (the target's argmax for greedy rows); after k
acceptances, a bonus token from p_{k+1}.

Randomness per row: k uniforms, then one draw from the emitted token's distribution
(sampler.categorical: one more uniform). A seeded row draws both from its own generator,
so its tokens depend only on its seed, logits and drafts; with k = 0 it makes
exactly the draws sampler.sample makes, and gets the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pdserve.workers.buffers import small_tensor, to_device_async
from pdserve.workers.sampler import NO_TOKEN, SamplingBatch, argmax, categorical, sampling_probs


class Verified(NamedTuple):
    token_ids: list[list[int]]  # per row: accepted drafts + 1 token (1..num_drafts+1 of them)
    num_accepted: list[int]  # per row: drafts accepted, 0..num_drafts (for acceptance metrics)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: Sequence[int],
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """Accept or reject each row's drafts and sample the token that follows.

    target_logits: [B, K+1, V] float32, the target's raw logits; position i of
        row b scores the token after the context + draft_tokens[b, :i].
        Positions past num_drafts[b] may hold anything, NaN included (see
        unflatten_logits for the varlen layout). Modified in place, as by sample().
    draft_tokens: [B, K] int64, padded; only draft_tokens[b, :num_drafts[b]] is read.
    num_drafts: [B] python ints in 0..K.
    batch: the rows' sampling settings, one row per sequence, exactly as for
        sampler.sample (model_runner builds it). `banned` bans the tokens at
        every position of the row: for a row under min_tokens, draft at most
        min_tokens - num_output_tokens - 1 tokens so that all its positions are
        under the limit. `allowed` and `logit_bias` apply at every position;
        `penalties` must be None, and no row with bad words may have drafts
        (they depend on each position's history).
        `max_logprobs` is ignored: no logprobs are returned.
    draft_probs: [B, K, V], the distribution each draft token was really sampled from
        (the draft model's normalised probabilities after the request's own processing),
        or None for deterministic drafters (n-gram, argmax drafts), which is
        treated as one-hot at the draft token. Either way the output is exact
        (one-hot q is exact for any draft token, so for any distribution of drafts
        independent of the verifier's draws); the true q accepts more:
        sum(min(p, q)) on average instead of sum(p * q). Ignored for greedy rows.
    Returns the emitted tokens and accepted counts per row (one host sync).
    """
    _check_shapes(target_logits, draft_tokens, num_drafts, draft_probs)
    if batch.penalties is not None:
        # A penalty depends on the tokens before each position, drafts included: the
        # engine does not draft for such requests.
        raise ValueError("verify: rows with presence/frequency/repetition penalties cannot be verified")
    _ban_and_bias(target_logits, batch)
    positions, vocab = target_logits.shape[1:]
    drafts = draft_tokens.clamp(0, vocab - 1)  # padding may hold anything
    n_drafts = small_tensor(num_drafts, torch.int64, target_logits.device)
    valid = torch.arange(positions - 1, device=target_logits.device) < n_drafts[:, None]  # [B, K]
    greedy_ids = argmax(target_logits)  # [B, K+1]
    # A position whose pick has no finite logit (NaN, or all -inf: a grammar with nothing left)
    # accepts nothing, and the token emitted there is NO_TOKEN: the engine fails the request
    # alone, as sampler.checked has it without drafts.
    finite = torch.isfinite(target_logits.gather(2, greedy_ids[..., None])[..., 0])  # [B, K+1]
    accept = (drafts == greedy_ids[:, :-1]) & finite[:, :-1]
    if batch.all_greedy:
        num_accepted = _leading_trues(accept & valid)
        return _emitted(target_logits, drafts, num_accepted, greedy_ids.gather(1, num_accepted[:, None])[:, 0])

    generators = batch.generators or {}
    greedy_rows = batch.temperature == 0.0
    probs, total, random_accept = _random_accept(target_logits, drafts, num_drafts, batch, draft_probs)
    num_accepted = _leading_trues(torch.where(greedy_rows[:, None], accept, random_accept) & valid)
    # One token per row: from the residual at its first rejection, else the bonus from p.
    last = _at_position(probs, num_accepted)  # [B, V]
    residual = _residual(last, _at_position(total, num_accepted), drafts, num_accepted, draft_probs)
    last = torch.where((num_accepted < n_drafts)[:, None], residual, last)
    greedy_tokens = greedy_ids.gather(1, num_accepted[:, None])[:, 0]
    return _emitted(target_logits, drafts, num_accepted,
                    torch.where(greedy_rows, greedy_tokens, categorical(last, generators)))


def _ban_and_bias(target_logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Apply each row's allowed and banned tokens and logit bias, in place, at every position of the row."""
    if batch.allowed:
        for row, only in batch.allowed:
            keep = target_logits[row, :, only]
            target_logits[row] = float("-inf")
            target_logits[row, :, only] = keep
    if batch.banned:
        for row, ids in batch.banned:
            target_logits[row, :, ids] = float("-inf")
    if batch.logit_bias:  # the same at every position
        for row, bias_ids, bias in batch.logit_bias:
            target_logits[row, :, bias_ids] += bias


def _random_accept(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: Sequence[int],
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' target probs [B, K+1, V], their totals [B, K+1, 1], and which drafts a random row
    accepts [B, K]: each with probability min(1, p/q), drawing the rows' uniforms."""
    rows, positions, vocab = target_logits.shape
    probs = _target_probs(target_logits.reshape(rows * positions, vocab), batch, positions).view(rows, positions, vocab)
    total = probs.sum(dim=-1, keepdim=True)  # [B, K+1, 1]: unnormalised after min-p, like sampler's
    p_draft = probs[:, :-1].gather(2, drafts[..., None])[..., 0] / total[:, :-1, 0]  # [B, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
    uniforms = _uniforms(num_drafts, positions - 1, batch.generators or {}, probs.device)
    return probs, total, uniforms * q_draft < p_draft  # never accepted where p = 0


def pad_drafts(
    drafts: Sequence[np.ndarray | Sequence[int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, list[int]]:
    """Ragged drafts (e.g. NgramProposer outputs) -> (draft_tokens [B, K] int64
    padded with 0, num_drafts) for `verify`; K is the longest draft."""
    num_drafts = [len(d) for d in drafts]
    padded = np.zeros((len(drafts), max(num_drafts, default=0)), dtype=np.int64)
    for row, d in enumerate(drafts):
        padded[row, : len(d)] = d
    return to_device_async(torch.from_numpy(padded), device), num_drafts


def unflatten_logits(logits: torch.Tensor, num_drafts: Sequence[int]) -> torch.Tensor:
    """[sum(num_drafts[b] + 1), V] rows, sequence after sequence (the varlen
    layout a verify pass produces) -> [B, K+1, V] for `verify`; a row's padding
    repeats its last position."""
    sizes = np.asarray(num_drafts, dtype=np.int64) + 1
    starts = np.cumsum(sizes) - sizes
    k = int(sizes.max(initial=1)) - 1
    index = starts[:, None] + np.minimum(np.arange(k + 1)[None, :], sizes[:, None] - 1)
    return logits[torch.from_numpy(index).to(logits.device)]


def _target_probs(logits: torch.Tensor, batch: SamplingBatch, positions: int) -> torch.Tensor:
    """[B*(K+1), V] -> probs, each row processed with its sequence's settings
    exactly as the sampler does before its draw (unnormalised after min-p)."""

    def per_position(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(positions)

    temperature = per_position(batch.temperature)
    assert temperature is not None
    return sampling_probs(logits, temperature, per_position(batch.top_k), per_position(batch.top_p),
                          per_position(batch.min_p), batch.top_k_max)


def _at_position(t: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """t[b, position[b]] for every row b: [B, P, X] -> [B, X]."""
    return t.gather(1, position[:, None, None].expand(-1, 1, t.shape[2]))[:, 0]


def _residual(
    p: torch.Tensor,
    total: torch.Tensor,
    drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> torch.Tensor:
    """[B, V] max(0, p/total - q) at each row's position num_accepted; only
    read for rows that rejected there, so rows that accepted all K may hold anything."""
    if drafts.shape[1] == 0:
        return p
    at = num_accepted.clamp(max=drafts.shape[1] - 1)
    if draft_probs is None:  # q one-hot at the draft token: p without that token
        residual = p.scatter(1, drafts.gather(1, at[:, None]), 0.0)
    else:
        residual = (p / total - _at_position(draft_probs, at)).clamp_(min=0.0)
    # p == q up to rounding leaves nothing: then rejection had probability ~0 and p is as good.
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    return torch.where(empty, p, residual)


def _uniforms(
    num_drafts: Sequence[int], k: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """[B, K] U[0, 1); a seeded row draws exactly its num_drafts from its generator."""
    shape = (len(num_drafts), k)
    if k == 0 or len(generators) == shape[0]:  # k = 0 draws nothing, so sampling matches sampler.sample
        uniforms = torch.empty(shape, device=device)
    else:
        uniforms = torch.rand(shape, device=device)
    for row, gen in generators.items():
        if num_drafts[row]:
            uniforms[row, : num_drafts[row]] = torch.rand(num_drafts[row], generator=gen, device=device)
    return uniforms


def _leading_trues(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64: how many positions before the first False."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _emitted(target_logits: torch.Tensor, drafts: torch.Tensor, num_accepted: torch.Tensor,
             tokens: torch.Tensor) -> Verified:
    """The rows' accepted drafts and their last tokens; NO_TOKEN for a last token that is not a
    real choice (outside the vocabulary, or its processed logit not finite: sampler.checked)."""
    vocab = target_logits.shape[-1]
    safe = tokens.clamp(0, vocab - 1)
    rows = torch.arange(len(tokens), device=tokens.device)
    ok = (tokens == safe) & torch.isfinite(target_logits[rows, num_accepted, safe])
    tokens = torch.where(ok, tokens, torch.full_like(tokens, NO_TOKEN))
    drafts_list, accepted, last = drafts.tolist(), num_accepted.tolist(), tokens.tolist()
    return Verified([d[:a] + [t] for d, a, t in zip(drafts_list, accepted, last)], accepted)


def _check_shapes(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: Sequence[int], draft_probs: torch.Tensor | None
) -> None:
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, K+1, V], got {tuple(target_logits.shape)}")
    rows, positions, vocab = target_logits.shape
    if tuple(draft_tokens.shape) != (rows, positions - 1):
        raise ValueError(f"draft_tokens must be [B, K] = {(rows, positions - 1)}, got {tuple(draft_tokens.shape)}")
    if len(num_drafts) != rows or any(not 0 <= n < positions for n in num_drafts):
        raise ValueError(f"num_drafts must be {rows} ints in 0..{positions - 1}, got {list(num_drafts)}")
    want = (rows, positions - 1, vocab)
    if draft_probs is not None and tuple(draft_probs.shape) != want:
        raise ValueError(f"draft_probs must be [B, K, V] = {want}, got {tuple(draft_probs.shape)}")
