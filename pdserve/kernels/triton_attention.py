"""The Triton attention backend: KV write (fused with RoPE when the model hands over
its qkv output), paged decode for the single-token rows, flash prefill for the
multi-token chunks, all in one output buffer."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.triton_cache import write_kv
from pdserve.kernels.triton_decode import paged_decode_attention
from pdserve.kernels.triton_prefill import prefill_attention
from pdserve.kernels.triton_rope_cache import rope_and_write_kv


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`: [T, H, D] queries -> [T, H*D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    return attend(q, k_cache, v_cache, meta, scale, kv_scales)


def rope_paged_attention(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """`paged_attention` of the fused qkv projection's output before RoPE: the rotation and
    the cache write in one launch (pdserve/kernels/triton_rope_cache.py), then the attention."""
    q = rope_and_write_kv(qkv, num_heads, num_kv_heads, positions, cos, sin, k_cache, v_cache, meta.slot_mapping,
                          kv_scales)
    return attend(q, k_cache, v_cache, meta, scale, kv_scales)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """[T, H, D] queries over the paged cache, which holds this step's keys already -> [T, H*D]."""
    out = torch.empty_like(q)
    nd = meta.num_decode_seqs
    if nd:
        # Decode rows: grid and split count come from capacities (block table
        # width), so a CUDA graph can replay this launch.
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                               meta.query_start_loc[: nd + 1], scale, max_query_len=1, out=out, kv_scales=kv_scales)
    if nd < meta.num_seqs:
        max_query_len = int(np.diff(meta.query_start_loc_np[nd:]).max())
        prefill_attention(q, k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                          meta.query_start_loc[nd:], scale, max_query_len, out=out, kv_scales=kv_scales)
    return out.view(q.shape[0], -1)
