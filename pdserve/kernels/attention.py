"""The attention op the model calls, on the backend chosen (kernels/backend_choice.py)."""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_decode, reference
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.kernels.metadata import AttentionMetadata


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: AttentionBackend = AttentionBackend.TORCH,
    kv_scales: tuple[float, float] = reference.UNIT_SCALES,
) -> torch.Tensor:
    """Write new K/V [T, KVH, D] into their slots and return attention output [T, H*D].

    Queries are [T, H, D] with RoPE applied. Causal within each sequence; the
    sequence's earlier tokens are read from the cache through its block table.
    An fp8 cache (float8_e4m3fn) stores K / kv_scales[0] and V / kv_scales[1].
    """
    if backend is AttentionBackend.TRITON:
        from pdserve.kernels import triton_attention  # imports triton: only when asked for

        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, kv_scales)
    if k_cache.dtype != q.dtype:  # an fp8 cache: the C++ op reads the model's dtype only
        return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale, kv_scales=kv_scales)
    if cpu_decode.usable(q, k_cache, meta):  # a CPU decode step: one C++ op instead of ~20 tensor calls
        return cpu_decode.paged_decode(q, k, v, k_cache, v_cache, meta, scale)
    if cpu_decode.usable_for_decode_rows(q, k_cache, meta):  # mixed: the op for its one-token rows
        return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale, decode=cpu_decode.decode_rows)
    return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
