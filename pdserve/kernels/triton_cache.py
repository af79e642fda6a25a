"""Triton KV-cache write: scatter each new token's K and V into its paged slot.

Cache layout (shared with `reference` and the KV transport):
k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim], possibly
non-contiguous views into a bigger allocation, so every access goes through
strides. One program per token writes all KV heads of both K and V; a slot of
-1 means "skip this token" (padding rows of a CUDA-graph batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_value(x):
    """float32 x, within e4m3's range (clamped), rounded to the nearest e4m3 value (ties to even),
    still float32: its cast to e4m3 is then exact. Not left to the cast itself: Triton's CPU
    interpreter rounds some values up across a power of two wrongly (7.77 -> 4.0); the GPU's
    conversion agrees with this. The ulp of x's binade (at least the subnormals' 2^-9) comes
    from its exponent bits; adding and subtracting 1.5 * 2^23 ulps rounds to a multiple of it."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    m = ulp * 12582912.0
    r = (x + m) - m
    return tl.where(r == 0.0, x * 0.0, r)  # keep a negative's sign (-0), as torch's cast does


@triton.jit
def to_e4m3(x, inv_scale):
    """What an fp8 cache stores for `x` (reference.to_cache): scaled, clamped, rounded."""
    return e4m3_value(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0))


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    block_size, inv_k_scale, inv_v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size

    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    h = h.to(tl.int64)[:, None]
    d = d.to(tl.int64)[None, :]

    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd
    if FP8:  # scaled, clamped to e4m3's range (a cast past it is NaN) and rounded: reference.to_cache
        k = to_e4m3(k, inv_k_scale)
        v = to_e4m3(v, inv_v_scale)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, KVH, D], any strides
    v: torch.Tensor,  # [T, KVH, D], any strides
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 flat slot (block * block_size + offset); -1 = skip
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's K and V scales
) -> None:
    """Scatter new keys/values into their cache slots (same result as `reference.write_kv`)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [blocks, block_size, kv_heads, head_dim]: "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/dim {tuple(k_cache.shape[2:])} != k {(num_kv_heads, head_dim)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # Keep one program's tile around 4K elements: all heads at once for small models.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1], 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
