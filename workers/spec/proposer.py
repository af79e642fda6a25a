"""What the speculator asks of a proposer: the n-gram lookup (spec/ngram.py) or a
draft model (spec/draft.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.workers.request import Request

# Per request: its draft tokens, and the distribution [len, V] they were sampled
# from (None for deterministic drafts: verification takes them as one-hot).
Drafts = tuple[list[list[int]], list[torch.Tensor | None]]


class Proposer(Protocol):
    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        """Up to `ks[i]` draft tokens for `requests[i]`, each decoding (every token
        but its last is in the target's cache). Engine thread; may run a model."""
        ...

    def retain(self, request_ids: set[str]) -> None:
        """Forget every request not in `request_ids` (finished, aborted or preempted):
        whatever the proposer keeps for one (a draft model's KV) is freed."""
        ...
