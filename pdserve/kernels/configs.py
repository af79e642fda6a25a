"""Launch configs of the attention kernels: the defaults and the tuning sweep.

A config is what Triton cannot pick for itself: tile sizes, warps per
program, and pipeline depth. The defaults were chosen from what a compile
for sm_90 costs (pdserve/kernels/static_check.py, `python bench/kernels_static.py`;
table in docs/kernels.md), not from GPU timings: none were measured yet.
`python bench/kernels_gpu.py --tune` times every config of the sweeps on a
lent GPU and prints which one wins.

Why these defaults (registers, spills, pipelined loads, programs per SM for
each config): docs/kernels.md, "Launch configs".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeConfig:
    tile_n: int  # KV tokens per loop iteration (independent of the page size)
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {self.tile_n}")
        _check_launch(self.num_warps, self.num_stages)

    def label(self) -> str:
        return f"tile{self.tile_n}/w{self.num_warps}/s{self.num_stages}"


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # rows per program: query tokens x the (padded) GQA group
    tile_n: int  # KV tokens per loop iteration
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if min(self.block_m, self.tile_n) < 16 or self.block_m & (self.block_m - 1) or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"block_m={self.block_m} / tile_n={self.tile_n} must be powers of two >= 16")
        _check_launch(self.num_warps, self.num_stages)

    def label(self) -> str:
        return f"m{self.block_m}/n{self.tile_n}/w{self.num_warps}/s{self.num_stages}"


def _check_launch(num_warps: int, num_stages: int) -> None:
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be a power of two <= 16, got {num_warps}")
    if not 1 <= num_stages <= 6:
        raise ValueError(f"num_stages must be in 1..6, got {num_stages}")


def decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The default paged-decode config."""
    if dtype == torch.float32 or head_dim > 128:
        return DecodeConfig(tile_n=32, num_warps=4, num_stages=3)  # twice the bytes per tile
    return DecodeConfig(tile_n=64, num_warps=4, num_stages=3)


def prefill_config(group_pad: int, head_dim: int, max_query_len: int, dtype: torch.dtype,
                   arch: int = 0) -> PrefillConfig:
    """The default prefill config for chunks of up to `max_query_len` tokens on compute
    capability `arch` (90 for sm_90; 0 when unknown: a config that fits every supported card)."""
    # 128 rows for real prefill chunks; fewer for short ones so padding rows stay few.
    block_m = min(128, max(16, _next_pow2(max(1, max_query_len) * group_pad)))
    # Hopper's and datacenter Blackwell's 227 KiB of shared memory hold three stages of 128-token
    # K and V tiles (161 KiB at head_dim 128); on an H200 that is 1.14x the 64-token tile at 1x4k
    # and 1.26x at 1x16k (docs/kernels.md "GPU numbers"). Ampere, Ada and sm_120 (99-163 KiB per
    # program) keep 64.
    tile_n = 128 if arch // 10 in (9, 10) and block_m >= 128 else 64
    if head_dim > 128 or dtype == torch.float32:
        # fp32 tiles are twice the bytes and its 3-pass dot splits each operand in two:
        # smaller tiles keep registers and shared memory in budget.
        block_m, tile_n = min(block_m, 64), 32
    block_m = max(block_m, group_pad)
    return PrefillConfig(block_m=block_m, tile_n=tile_n, num_warps=8 if block_m >= 128 else 4, num_stages=3)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# The sweeps `bench/kernels_gpu.py --tune` times (half precision, head dim <= 128).
# Every entry compiles for sm_90 without register spills (tests/kernels/test_static_compile.py).
DECODE_SWEEP: tuple[DecodeConfig, ...] = tuple(
    DecodeConfig(tile_n=t, num_warps=w, num_stages=s)
    for t in (32, 64, 128) for w in (4, 8) for s in (2, 3)
)
PREFILL_SWEEP: tuple[PrefillConfig, ...] = (
    PrefillConfig(64, 32, 4, 3), PrefillConfig(64, 64, 4, 2), PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 64, 8, 3), PrefillConfig(64, 128, 8, 3),
    PrefillConfig(128, 32, 8, 3), PrefillConfig(128, 64, 8, 2), PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 4), PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 128, 8, 3),
)
