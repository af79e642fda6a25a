"""Fused residual add + RMSNorm in one Triton launch.

    new_residual = x + residual            (rounded to x.dtype, like torch's add)
    normed = weight * (h32 * rsqrt(mean(h32^2) + eps)).to(x.dtype)

with h32 = new_residual in float32: the normalisation runs in float32 and is cast
back to x.dtype BEFORE the weight multiply, transformers' order (and
`pdserve.workers.model.layers.RMSNorm`). The weight product is formed in float32
and rounded once to x.dtype, which is bit-identical to torch's half-precision
multiply when the weight has x's dtype.

One program per row. Rows up to `_MAX_SINGLE_BLOCK` wide live in registers
(one read of x and residual, one write of each output); wider rows loop over
chunks in two passes, re-reading the inputs in the second. With residual None
the new residual is x itself (returned as is, nothing is written for it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Widest row kept whole in registers; wider ones take the chunked two-pass loop.
_MAX_SINGLE_BLOCK = 16384
_CHUNK = 4096


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    H, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    res_out_row = res_out_ptr + row * stride_res_out
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < H
        h = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_row + cols, mask=mask, other=0.0)
            # Round the sum to the activation dtype first: that is the residual
            # the next layer sees, and the value torch normalises.
            h = (h.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, h, mask=mask)
        h32 = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h32 * h32, axis=0) / H + eps)
        normed = (h32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            c = start + cols
            mask = c < H
            h = tl.load(x_row + c, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_row + c, mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
                tl.store(res_out_row + c, h, mask=mask)
            h32 = h.to(tl.float32)
            acc += h32 * h32
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        # Second pass recomputes h from the inputs (not from res_out): no
        # reliance on this program's own stores being visible across threads.
        for start in range(0, H, BLOCK):
            c = start + cols
            mask = c < H
            h = tl.load(x_row + c, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_row + c, mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            normed = (h.to(tl.float32) * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + c, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """A 2-D view [T, H] with unit column stride (copies only when it must)."""
    t = t.reshape(-1, H) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block: int, elem_size: int) -> int:
    # ~16 bytes per thread per load: 4096 bf16 -> 8 warps.
    return max(1, min(16, int(triton.next_power_of_2(block * elem_size // (16 * 32)))))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for x [T, H] (rows may be strided), residual [T, H] or None, weight [H].

    new_residual = x + residual (x itself when residual is None); normed has x's
    dtype. Both outputs are fresh contiguous tensors (except new_residual = x).
    """
    if x.dim() != 2:
        raise ValueError(f"fused_add_rms_norm: x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if weight.shape != (H,):
        raise ValueError(f"fused_add_rms_norm: weight must be [{H}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"fused_add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    xx = _rows(x, H)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if residual is not None:
        rr = _rows(residual, H)
        res_out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    else:
        rr, res_out = xx, out  # unused by the kernel (HAS_RESIDUAL=False)
    if T == 0:
        return out, (res_out if residual is not None else x)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    full = triton.next_power_of_2(H)
    single = full <= _MAX_SINGLE_BLOCK
    block = full if single else _CHUNK
    _fused_add_rms_norm_kernel[(T,)](
        xx, rr, w, out, res_out,
        H, float(eps),
        xx.stride(0), rr.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        SINGLE=single,
        num_warps=_num_warps(block, x.element_size()),
    )
    return out, (res_out if residual is not None else x)
