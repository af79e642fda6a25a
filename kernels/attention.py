"""The attention op the model calls, and the choice of backend behind it."""

from __future__ import annotations

import enum

import torch

from pdserve.kernels import reference
from pdserve.kernels.metadata import AttentionMetadata


class AttentionBackend(str, enum.Enum):
    TORCH = "torch"
    TRITON = "triton"
    AUTO = "auto"

    def resolve(self, device: torch.device) -> "AttentionBackend":
        """The concrete backend for `device` (auto: the reference until the Triton kernels land)."""
        if self is AttentionBackend.TRITON:
            raise ValueError("attention_backend: 'triton' is not available in this build; use 'torch' or 'auto'")
        return AttentionBackend.TORCH


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: AttentionBackend = AttentionBackend.TORCH,
) -> torch.Tensor:
    """Write new K/V [T, KVH, D] into their slots and return attention output [T, H*D].

    Queries are [T, H, D] with RoPE applied. Causal within each sequence; the
    sequence's earlier tokens are read from the cache through its block table.
    """
    return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
