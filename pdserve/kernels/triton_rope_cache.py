"""RoPE on q and k, and the KV-cache write, in one Triton launch.

From the fused qkv projection's output [T, (H + 2 KVH) D], per token:

    q_out[t]              = rope(q[t])                  (a fresh [T, H, D])
    k_cache[slot[t]]      = rope(k[t])
    v_cache[slot[t]]      = v[t]                        (slot -1: no cache write)

the same values, rounded the same way, as `triton_rope.apply_rope` on q and k
followed by `triton_cache.write_kv` (rotation in float32, rounded to qkv's
dtype, then to the cache's), without the roped k ever going to memory and
with one launch where there were two. The H200 profile of a decode step put
RoPE at 65-76 us and the KV write at 45-52 us a step (issue 49).

The cache layout is `triton_cache`'s: [num_blocks, block_size, KVH, D], any
strides. One program per token does all of its heads: at decode the work per
token is a few thousand elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_cache import to_e4m3


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_t, stride_qt, stride_qh,
    stride_cp, stride_cd, stride_sp, stride_sd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    block_size, inv_k_scale, inv_v_scale,
    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 2 * HALF
    row = qkv_ptr + t * stride_t
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_cp + d * stride_cd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sp + d * stride_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    dd = d.to(tl.int64)[None, :]

    # q: rotated into its own output.
    hq = tl.arange(0, BLOCK_H)
    mq = (hq < H)[:, None] & dmask[None, :]
    src = row + hq.to(tl.int64)[:, None] * D + dd
    x1 = tl.load(src, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mq, other=0.0).to(tl.float32)
    dst = q_ptr + t * stride_qt + hq.to(tl.int64)[:, None] * stride_qh + dd
    tl.store(dst, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mq)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a CUDA-graph bucket's padding row, nothing to cache
        blk = slot // block_size
        off = slot % block_size
        hk = tl.arange(0, BLOCK_KVH)
        mk = (hk < KVH)[:, None] & dmask[None, :]
        hk64 = hk.to(tl.int64)[:, None]
        # k: rotated straight into its slot (rounded to qkv's dtype first, as apply_rope's output is).
        src = row + (H + hk64) * D + dd
        k1 = tl.load(src, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(src + HALF, mask=mk, other=0.0).to(tl.float32)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + hk64 * stride_kch + dd * stride_kcd
        ka = (k1 * cos - k2 * sin).to(qkv_ptr.dtype.element_ty)
        kb = (k2 * cos + k1 * sin).to(qkv_ptr.dtype.element_ty)
        # v: copied.
        src = row + (H + KVH + hk64) * D + dd
        va = tl.load(src, mask=mk, other=0.0)
        vb = tl.load(src + HALF, mask=mk, other=0.0)
        if FP8:  # scaled, clamped and rounded as reference.to_cache (triton_cache.to_e4m3)
            ka, kb = to_e4m3(ka, inv_k_scale), to_e4m3(kb, inv_k_scale)
            va, vb = to_e4m3(va, inv_v_scale), to_e4m3(vb, inv_v_scale)
        tl.store(kc, ka.to(k_cache_ptr.dtype.element_ty), mask=mk)
        tl.store(kc + HALF * stride_kcd, kb.to(k_cache_ptr.dtype.element_ty), mask=mk)
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + hk64 * stride_vch + dd * stride_vcd
        tl.store(vc, va.to(v_cache_ptr.dtype.element_ty), mask=mk)
        tl.store(vc + HALF * stride_vcd, vb.to(v_cache_ptr.dtype.element_ty), mask=mk)


def rope_and_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], rows may be strided, columns contiguous
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [P, D/2] half tables (triton_rope.rope_cos_sin)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] flat slot; -1 = no cache write
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's K and V scales
) -> torch.Tensor:
    """The roped queries [T, H, D]; roped keys and the values written into their slots."""
    if qkv.dim() != 2:
        raise ValueError(f"rope_and_write_kv: qkv must be [T, (H + 2 KVH) D], got shape {tuple(qkv.shape)}")
    num_tokens = qkv.shape[0]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [blocks, block_size, kv_heads, head_dim]: "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    head_dim = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rope_and_write_kv: qkv width {qkv.shape[1]} != ({num_heads} + 2 x {num_kv_heads}) x "
                         f"{head_dim}, or the cache's {k_cache.shape[2]} kv heads != {num_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"rope_and_write_kv: head dim must be even, got {head_dim}")
    half = head_dim // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"rope_and_write_kv: cos/sin must be [P, {half}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"rope_and_write_kv: positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be [{num_tokens}]")
    x = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_h, block_kvh = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(half)
    _rope_write_kv_kernel[(num_tokens,)](
        x, positions, cos, sin, q, k_cache, v_cache, slot_mapping,
        x.stride(0), q.stride(0), q.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1], 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        H=num_heads, KVH=num_kv_heads, HALF=half,
        BLOCK_H=block_h, BLOCK_KVH=block_kvh, BLOCK_HALF=block_half, FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=max(1, min(8, block_h * block_half // 256)),
    )
    return q
