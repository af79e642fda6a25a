"""How good a trained tiny pair is, on held-out windows: each model's next-token loss, how often the
draft's greedy next token is the target's, and how many draft tokens greedy speculative decoding accepts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

# Acceptance-length measurement: this many held-out prompts, each followed by
# the target's greedy continuation, verified k draft tokens at a time.
_ACCEPT_PROMPTS = 64
_ACCEPT_NEW_TOKENS = 64
_ACCEPT_K = 4


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over `windows` [N, T + 1]."""
    total = 0.0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    return total / (len(windows) * (windows.shape[1] - 1))


@torch.no_grad()
def greedy_agreement(draft: PreTrainedModel, target: PreTrainedModel, windows: torch.Tensor,
                     batch_size: int = 8) -> float:
    """Fraction of positions of `windows` where the two models' argmax next tokens are equal."""
    same = 0
    for i in range(0, len(windows), batch_size):
        inputs = windows[i : i + batch_size, :-1]
        same += int((draft(input_ids=inputs).logits.argmax(-1) == target(input_ids=inputs).logits.argmax(-1)).sum())
    return same / windows[:, :-1].numel()


@torch.no_grad()
def acceptance(draft: PreTrainedModel, target: PreTrainedModel, prompts: torch.Tensor, new_tokens: int,
               k: int) -> float:
    """Mean draft tokens accepted per verify step in greedy speculative decoding with `k` proposals.

    Exact without running the loop: the draft's j-th proposal only counts if
    proposals 1..j-1 equalled the target's tokens, so its context is always
    the target's own greedy sequence. Teacher-forcing the draft on that
    sequence gives every proposal that matters in one forward pass.
    """
    out = target(input_ids=prompts, use_cache=True)
    generated = [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(input_ids=generated[-1][:, None], cache=out.cache, use_cache=True)
        generated.append(out.logits[:, -1].argmax(-1))
    gen = torch.stack(generated, dim=1)  # [N, G]
    seq = torch.cat([prompts, gen], dim=1)
    match = draft(input_ids=seq[:, :-1]).logits[:, prompts.shape[1] - 1 :].argmax(-1) == gen  # [N, G]
    accepted: list[int] = []
    for row in match.tolist():
        i = 0
        while i < len(row):
            a = 0
            while a < k and i + a < len(row) and row[i + a]:
                a += 1
            accepted.append(a)
            i += a + 1  # the accepted tokens, then the target's own token
    return sum(accepted) / len(accepted)


def pair_quality(draft: PreTrainedModel, target: PreTrainedModel, heldout: torch.Tensor) -> dict[str, float]:
    """What quality.json records about the pair: greedy agreement and acceptance lengths on `heldout`."""
    prompt_len = min(64, heldout.shape[1])
    accepted = acceptance(draft, target, heldout[:_ACCEPT_PROMPTS, :prompt_len], _ACCEPT_NEW_TOKENS, _ACCEPT_K)
    return {
        "greedy_next_token_agreement": round(greedy_agreement(draft, target, heldout), 4),
        f"accepted_per_step_k{_ACCEPT_K}": round(accepted, 3),
        # What one target forward yields: the accepted tokens plus its own.
        f"tokens_per_target_step_k{_ACCEPT_K}": round(accepted + 1, 3),
    }
