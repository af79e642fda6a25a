"""KV cache tensors and how many blocks fit a memory budget."""

from __future__ import annotations

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


def kv_budget_bytes(device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float,
                    activation_reserve: int) -> int:
    """Bytes the KV cache may take: explicit, or what the device has left."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free
    return int(total * gpu_memory_utilization) - used_by_others - activation_reserve
