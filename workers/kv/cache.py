"""KV cache tensors and how many blocks fit a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.workers.model.config import ModelConfig

# vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE): room for real models' contexts.
CPU_DEFAULT_KV_BYTES = 4 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim].

    One allocation for the whole cache; K and V of a layer are views into it.
    """
    full = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                       dtype=dtype, device=device)
    return [(full[i, 0], full[i, 1]) for i in range(cfg.num_layers)]


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
