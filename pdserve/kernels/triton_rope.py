"""Neox-style (half-split) rotary embedding in one Triton launch.

    out[..., :D/2] = x1 * cos - x2 * sin
    out[..., D/2:] = x2 * cos + x1 * sin        (x1 = x[..., :D/2], x2 = x[..., D/2:])

with cos/sin the half tables [P, D/2] looked up at each token's position. The
tables carry any frequency scaling (llama3, linear): the kernel only rotates.
Arithmetic is float32, rounded once to x's dtype.

x is [T, NH, D] and may be a strided view (q and k sliced out of the fused qkv
projection output, NH = H + KVH): every stride is honoured, nothing is copied.
The output is a fresh contiguous [T, NH, D] tensor of x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
    NH, HALF,
    stride_xt, stride_xh, stride_xd,
    stride_ot, stride_oh,
    stride_cp, stride_cd, stride_sp, stride_sd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cp + d * stride_cd, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sp + d * stride_sd, mask=dmask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    mask = (heads[:, None] < NH) & dmask[None, :]
    x1_ptrs = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh + d[None, :] * stride_xd
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    o1_ptrs = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o1_ptrs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, NH, D] (any strides) at positions [T] with half tables cos/sin [P, D/2]."""
    if x.dim() != 3:
        raise ValueError(f"apply_rope: x must be [T, NH, D], got shape {tuple(x.shape)}")
    T, NH, D = x.shape
    if D % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {D}")
    half = D // 2
    if cos.dim() != 2 or cos.shape[1] != half or sin.shape != cos.shape:
        raise ValueError(f"apply_rope: cos/sin must be [P, {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"apply_rope: positions must be [{T}], got {tuple(positions.shape)}")
    out = torch.empty((T, NH, D), dtype=x.dtype, device=x.device)
    if T == 0 or NH == 0:
        return out
    block_d = triton.next_power_of_2(half)
    # Up to ~2K elements of each half per program, in whole heads; prefer a
    # power of two dividing NH (40 = 5 x 8 for Llama-3-8B q+k) so no lanes idle.
    cap = max(1, 2048 // block_d)
    low_bit = NH & -NH
    block_h = min(low_bit, cap) if low_bit >= 4 or low_bit >= cap else min(triton.next_power_of_2(NH), cap)
    grid = (T, triton.cdiv(NH, block_h))
    _rope_kernel[grid](
        x, positions, cos, sin, out,
        NH, half,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=max(1, min(8, block_h * block_d // 256)),
    )
    return out


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Half tables (cos, sin), each [max_positions, D/2] of `dtype`, on inv_freq's device.

    Angles in float32 exactly as transformers (and layers.RotaryEmbedding) form
    them: position (int64 -> float32) times inv_freq, then cos/sin, then cast.
    """
    pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq.float()[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)
