"""The one description of a packed batch that every attention backend reads.

Tokens of a step are packed into one flat batch ("varlen"): the first
`num_decode_seqs` rows are sequences with exactly one new token (decode, or
the last token of a prefill), the rest are multi-token chunks (prefill). Each
sequence's keys live in the paged cache; its block table lists the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    # -- device tensors (views of the runner's persistent buffers) --
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32: block ids per sequence, padded
    seq_lens: torch.Tensor  # [S] int32: tokens in the cache for each sequence after this step
    query_start_loc: torch.Tensor  # [S + 1] int32: where each sequence's new tokens start in the batch
    # -- host-side copies, so a backend never has to read the device to plan --
    num_decode_seqs: int  # sequences [0, num_decode_seqs) have exactly one new token
    seq_lens_np: np.ndarray  # [S]
    query_start_loc_np: np.ndarray  # [S + 1]
    block_size: int
    # A CUDA-graph bucket's batch (workers/cuda_graphs.py): rows past the real ones are padding
    # (slot -1: write nothing; seq_len 0: attend to nothing), and the host arrays above are
    # bounds fixed for the bucket (seq_lens_np: the block tables' capacity), not this step's values.
    padded: bool = False
    # Per-step scratch a backend may fill once and reuse in every layer (masks,
    # gathered indices): keyed by backend name.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_np)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_np[-1])
