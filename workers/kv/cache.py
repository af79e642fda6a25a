"""KV cache tensors and how many blocks fit a memory budget."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

import torch

from pdserve.workers.model.config import ModelConfig

# vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE): room for real models' contexts.
CPU_DEFAULT_KV_BYTES = 4 << 30

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_MADV_HUGEPAGE = 14  # <sys/mman.h>


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
    """A zeroed CPU tensor whose memory Linux is asked to back with 2 MiB pages (madvise
    MADV_HUGEPAGE, before the first touch), for the pages of at least 2 MiB it spans.

    Why: a decode step reads each sequence's KV blocks scattered over the pool (4 GiB by default
    on a CPU), a 4 KiB page apart or more; with 4 KiB pages nearly every block read misses the TLB
    (a core's TLB covers ~8 MiB). The CPU decode attention op took 0.83-0.95x of its time on a
    4 GiB pool on huge pages (docs/serving-profile.md). Most distributions' default (`enabled` =
    madvise) honours the advice; where it is `never`, or off Linux, the tensor is the same zeroed
    tensor on small pages.
    """
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MiB boundary
    start = -raw.data_ptr() % HUGE_PAGE
    _madvise_huge(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE)
    # The view keeps `raw`'s storage alive; zero_ is the first touch, so the faults come in huge pages.
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()


def _madvise_huge(addr: int, length: int) -> None:
    """Advice only: a kernel without transparent huge pages refuses it, and nothing else changes."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(addr, length, _MADV_HUGEPAGE)


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
