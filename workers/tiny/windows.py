"""The training data of the tiny pair: the tokenized stdlib corpus cut into packed windows (every
`heldout_every`-th file held out), and the seeded order in which training visits them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from . import tokenizer as tiny_tokenizer
from .corpus import corpus_files, stdlib_root


@dataclass(frozen=True)
class TokenWindows:
    """Packed token windows: row i is inputs `[:-1]` and labels `[1:]`."""

    train: torch.Tensor  # [N, seq_len + 1] int64
    heldout: torch.Tensor  # [M, seq_len + 1] int64


def corpus_windows(
    tok: Tokenizer, corpus_bytes: int, seq_len: int, heldout_every: int, skip_dirs: tuple[str, ...] = ()
) -> TokenWindows:
    """Tokenize the corpus, file by file joined by EOS, and cut it into windows of `seq_len + 1`.

    Files under a directory named in `skip_dirs` are left out.
    """
    eos = tiny_tokenizer.special_token_ids(tok)["eos"]
    root = stdlib_root()
    files = [f for f in corpus_files(corpus_bytes) if not set(f.relative_to(root).parts[:-1]) & set(skip_dirs)]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    streams: tuple[list[int], list[int]] = ([], [])
    for i, enc in enumerate(tok.encode_batch(texts)):
        streams[i % heldout_every == heldout_every - 1].extend([*enc.ids, eos])
    train, heldout = (_windows(s, seq_len) for s in streams)
    if len(heldout) == 0:
        raise ValueError(f"corpus_bytes: {corpus_bytes} bytes leave no held-out window of {seq_len + 1} tokens")
    return TokenWindows(train, heldout)


def _windows(ids: list[int], seq_len: int) -> torch.Tensor:
    n = max(0, (len(ids) - 1) // seq_len)
    if n == 0:
        return torch.empty(0, seq_len + 1, dtype=torch.long)
    # Stride seq_len: window i's last label is window i+1's first input.
    return torch.tensor(ids[: n * seq_len + 1], dtype=torch.long).unfold(0, seq_len + 1, seq_len)


def batch_order(num_windows: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Window indices for each step: epochs of seeded permutations, cut into batches."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while len(order) < batch_size:
            order = torch.cat([order, torch.randperm(num_windows, generator=gen)])
        yield order[:batch_size]
        order = order[batch_size:]
