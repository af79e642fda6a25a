"""Persistent input buffers: allocated once at the largest batch, filled each step.

Steps write into host memory (numpy views, pinned on CUDA) and copy the used
prefix to the device in one non-blocking copy. The device tensors never move,
so a captured CUDA graph can replay over them.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n rows, on the device (a view of the persistent tensor)."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.input_ids = StagedBuffer((max_tokens,), torch.int64, device)
        self.positions = StagedBuffer((max_tokens,), torch.int64, device)
        self.slot_mapping = StagedBuffer((max_tokens,), torch.int64, device)
        self.block_tables = StagedBuffer((max_seqs, max_blocks_per_seq), torch.int32, device)
        self.seq_lens = StagedBuffer((max_seqs,), torch.int32, device)
        self.query_start_loc = StagedBuffer((max_seqs + 1,), torch.int32, device)
        # One row per sampled sequence, or k+1 for a sequence verifying k drafts.
        self.logits_indices = StagedBuffer((max_tokens,), torch.int64, device)
