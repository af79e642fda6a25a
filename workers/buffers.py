"""Persistent input buffers: allocated once at the largest batch, filled each step.

Steps write into host memory (numpy views, pinned on CUDA) and copy the used
prefix to the device asynchronously. The device tensors never move, so a
captured CUDA graph replays over them (workers/cuda_graphs.py).

The reuse rule: a step may rewrite the host memory only after the copies that
read it last step have run. A non-blocking copy reads its pinned source when
the stream gets to it, which can be long after `copy_` returned (behind the
previous step's kernels). A step that samples ends on the read-back of its
tokens, a sync, but one that samples nothing (a middle chunk of a long prompt)
does not, and without a wait the next step would overwrite ids, positions and
slots that the pending copy has not read yet. So `begin_step` waits on a fence
that `end_step` recorded after the step's copies (a CUDA event). Copies go
through a `Copier`, which tests replace with a deferred one that queues them
like a stream (tests/workers/test_staging.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class Fence(Protocol):
    """A point in the copy stream (torch.cuda.Event is one)."""

    def synchronize(self) -> None:
        """Return once every copy issued before the fence has read its source."""


class Copier(Protocol):
    """Issues host-to-device copies that run later, in the order issued (a CUDA stream)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst <- src. `src` must stay unchanged until a later fence's synchronize()."""

    def fence(self) -> Fence:
        """A fence after every copy issued so far."""


class CudaCopier:
    """Copies on the current CUDA stream; fences are events recorded on it."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def fence(self) -> Fence:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event


class StagedBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 copier: Copier | None = None) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np: np.ndarray = self.cpu.numpy()
        self.copier = copier
        # On CPU without a copier the host tensor is the device tensor: nothing to copy.
        self.device = self.cpu if copier is None else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n rows, on the device (a view of the persistent tensor)."""
        if self.copier is not None and n:
            self.copier.copy(self.device[:n], self.cpu[:n])
        return self.device[:n]


class InputBuffers:
    """A step's inputs. Callers bracket each step's host writes and copies with
    `begin_step` / `end_step`. `copier`: how copies run (default: the CUDA stream
    on CUDA; none on CPU, where the host tensors are the device tensors)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 copier: Copier | None = None) -> None:
        if copier is None and device.type == "cuda":
            copier = CudaCopier()
        self.copier = copier
        self._fence: Fence | None = None

        def staged(shape: tuple[int, ...], dtype: torch.dtype) -> StagedBuffer:
            return StagedBuffer(shape, dtype, device, copier)

        self.input_ids = staged((max_tokens,), torch.int64)
        self.positions = staged((max_tokens,), torch.int64)
        self.slot_mapping = staged((max_tokens,), torch.int64)
        self.block_tables = staged((max_seqs, max_blocks_per_seq), torch.int32)
        self.seq_lens = staged((max_seqs,), torch.int32)
        self.query_start_loc = staged((max_seqs + 1,), torch.int32)
        # One row per sampled sequence, or k+1 for a sequence verifying k drafts.
        self.logits_indices = staged((max_tokens,), torch.int64)

    def begin_step(self) -> None:
        """Before the step's first host write: wait until last step's copies have read the host memory."""
        if self._fence is not None:
            self._fence.synchronize()
            self._fence = None

    def end_step(self) -> None:
        """After the step's last copy: fence them, for the next `begin_step`."""
        if self.copier is not None:
            self._fence = self.copier.fence()


def small_tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-step tensor of a few values, on `device` without a host sync: `torch.tensor(...,
    device="cuda")` copies from pageable memory, which synchronises the stream. Pinned memory from
    PyTorch's caching host allocator is not reused before the copy that reads it has run."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor made this step, on `device`; on CUDA through pinned memory, without a sync
    (see small_tensor)."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)
