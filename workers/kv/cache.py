"""KV cache tensors and how many blocks fit a memory budget."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.workers.model.config import ModelConfig

# vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE): room for real models' contexts.
CPU_DEFAULT_KV_BYTES = 4 << 30

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim].

    One allocation for the whole cache; K and V of a layer are views into it. On a CPU it lies on
    transparent huge pages where the kernel gives them (`cpu_zeros_on_huge_pages`).
    """
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cpu":
        full = cpu_zeros_on_huge_pages(shape, dtype)
    else:
        full = torch.zeros(shape, dtype=dtype, device=device)
    return [(full[i, 0], full[i, 1]) for i in range(cfg.num_layers)]


def cpu_zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping that Linux is asked to back with 2 MiB pages
    (madvise MADV_HUGEPAGE, before the first touch).

    Why: a decode step reads each sequence's KV blocks scattered over the pool (4 GiB by default
    on a CPU), a 4 KiB page apart or more; with 4 KiB pages nearly every block read misses the TLB
    (a core's TLB covers ~8 MiB). The CPU decode attention op took 0.83-0.93x of its time on a
    4 GiB pool on huge pages (`python bench/experiments/kv_huge_pages.py`, docs/performance.md). Most
    distributions' default (`enabled` = madvise) honours the advice; where it is `never`, or where
    Python has no MADV_HUGEPAGE (off Linux), the mapping keeps small pages.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # Private and anonymous (mmap's default for -1 is shared memory, which THP's madvise does not
    # cover); zero-filled; the tensor holds a reference to it.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    # Touch every page now, as torch.zeros did: the whole pool is taken at start-up (a machine
    # short of memory fails there, not mid-request), and the faults come in huge pages.
    return torch.frombuffer(buf, dtype=dtype).view(shape).zero_()


@dataclass(frozen=True)
class DeviceMemory:
    """What the KV budget on a GPU is computed from, all measured (bytes; workers/memory_plan.py
    measures them, docs/engine.md "Memory plan" says how)."""

    total: int  # the device's memory
    used_by_others: int  # in use before the engine allocated anything: other processes, this one's CUDA context
    weights: int  # what torch held after loading: the target's and the draft's weights (and RoPE tables)
    activations: int  # peak of the profile steps over what torch held before them
    non_torch: int = 0  # taken since the start outside torch's allocator (cuBLAS workspaces, NCCL, ...)

    @property
    def non_kv(self) -> int:
        return self.used_by_others + self.weights + self.activations + self.non_torch


def kv_budget_bytes(memory: DeviceMemory, gpu_memory_utilization: float) -> int:
    """Bytes the KV pool may take: what is left of `gpu_memory_utilization` of the device once
    other processes, the weights, the activations of the largest step and what this process
    holds outside torch are counted (negative: nothing is left)."""
    return int(memory.total * gpu_memory_utilization) - memory.non_kv


def tightest(memories: Sequence[DeviceMemory], gpu_memory_utilization: float) -> DeviceMemory:
    """Of the ranks' measured memories, the one that leaves the KV cache least: every rank holds
    as many blocks (each of its own heads), so that rank's budget is the pool's."""
    if not memories:
        raise ValueError("memory plan: no rank's memory to plan from")
    return min(memories, key=lambda m: kv_budget_bytes(m, gpu_memory_utilization))
