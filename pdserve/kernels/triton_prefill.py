"""Triton prefill attention over the paged KV cache (FA2-style forward).

Each sequence i has q_len = query_start_loc[i+1] - query_start_loc[i] new
tokens whose K/V are already in the cache (written by `write_kv`), after
context = seq_lens[i] - q_len earlier tokens. New row j attends causally to
positions [0, context + j], every one read through the block table.

Grid (num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q)). One program owns
BLOCK_Q query tokens x all query heads of one KV head (GQA group), i.e.
BLOCK_M = BLOCK_Q * GROUP_PAD rows, so each K/V tile is loaded once for the
whole group and `tl.dot` has M >= 16. Rows are token-major: row m is token
m // GROUP_PAD, head m % GROUP_PAD of the group (padding heads when the group
is not a power of two). K/V tiles of TILE_N tokens are independent of the page
size: each token's page comes from block_tables[i, pos // block_size].

The KV loop runs in two phases: tiles entirely before the program's first
query position need no causal mask; the rest (up to the last key the
program's last row needs) are masked. Softmax is online in base 2 with
scale * log2(e) folded into one multiply; accumulation is fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.configs import PrefillConfig, prefill_config

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q,
    k_cache_ptr, v_cache_ptr, bt_row_ptr, stride_btb,
    stride_kcb, stride_kcs, stride_kcd,
    stride_vcb, stride_vcs, stride_vcd,
    block_size, qk_scale, q_pos, kv_end,
    n_start, n_stop,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold key tiles [n_start, n_stop) into the running (acc, m_i, l_i).

    `k_cache_ptr`/`v_cache_ptr` already point at this program's KV head.
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    d64 = offs_d.to(tl.int64)
    for n0 in range(n_start, n_stop, TILE_N):
        pos = n0 + offs_n
        if MASKED:
            n_valid = pos < kv_end
        else:
            n_valid = offs_n < TILE_N  # every key of an unmasked tile is in range
        # Page of each key token: gathered through the block table.
        blk = tl.load(bt_row_ptr + (pos // block_size).to(tl.int64) * stride_btb, mask=n_valid, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        kv_mask = n_valid[:, None] & d_mask[None, :]
        # (An fp8 cache's values widen to q's dtype; the caller applies its scales.)
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs + d64[None, :] * stride_kcd,
                    mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + d64[None, :] * stride_vcd,
                    mask=kv_mask, other=0.0).to(q.dtype)

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & n_valid[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # NaN guard: a row with no visible key yet keeps m = -inf; subtract 0 instead.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btb,
    block_size, qk_scale, v_scale,  # qk_scale: times an fp8 cache's K scale; v_scale: its V scale (else 1)
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Program ids run roughly in launch order, axis 2 slowest: hand out the last
    # query blocks (the most keys, under causality) first, so the long programs
    # do not form the tail of the launch (as FlashAttention-2 does).
    q_block = tl.num_programs(2) - 1 - tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = q_block * BLOCK_Q
    if first_tok >= q_len:  # the grid is sized by the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = first_tok + offs_m // GROUP_PAD  # token index within this chunk
    head_in_group = offs_m % GROUP_PAD
    row_valid = (tok < q_len) & (head_in_group < GROUP)
    head = (kv_head * GROUP + head_in_group).to(tl.int64)
    row = (q_start + tok).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    d64 = offs_d.to(tl.int64)
    io_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d64[None, :] * stride_qd,
                mask=io_mask, other=0.0)

    q_pos = context + tok  # absolute position of each row: it sees keys [0, q_pos]
    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    kv_end = context + last_tok + 1  # keys the program's last row needs; later tiles are skipped
    # Keys [0, context + first_tok] are visible to every row: whole tiles there need no mask.
    n_unmasked = ((context + first_tok + 1) // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bts
    kc = k_cache_ptr + kv_head.to(tl.int64) * stride_kch
    vc = v_cache_ptr + kv_head.to(tl.int64) * stride_vch
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, kc, vc, bt_row_ptr, stride_btb,
        stride_kcb, stride_kcs, stride_kcd, stride_vcb, stride_vcs, stride_vcd,
        block_size, qk_scale, q_pos, kv_end, 0, n_unmasked,
        False, HEAD_DIM, BLOCK_D, TILE_N, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, kc, vc, bt_row_ptr, stride_btb,
        stride_kcb, stride_kcs, stride_kcd, stride_vcb, stride_vcs, stride_vcd,
        block_size, qk_scale, q_pos, kv_end, n_unmasked, kv_end,
        True, HEAD_DIM, BLOCK_D, TILE_N, DOT_PRECISION,
    )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows: never stored, but keep them finite
    o = acc * (v_scale / l_safe)[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d64[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


@functools.cache
def _arch_of(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def device_arch(device: torch.device) -> int:
    """The compute capability the default config is chosen for (0 off CUDA: the interpreter)."""
    if device.type != "cuda":
        return 0
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype, cuda: bool) -> str | None:
    """fp16/bf16: None (the setting only matters for fp32 operands). fp32 must match an
    fp32 reference (no plain TF32): on NVIDIA the 3-pass TF32 dot (~fp32 accuracy on
    tensor cores, and far fewer registers than the FMA dot); elsewhere IEEE."""
    if dtype != torch.float32:
        return None
    return "tf32x3" if cuda and torch.version.hip is None else "ieee"


def prefill_attention(
    q: torch.Tensor,  # [Nq, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, including this chunk
    query_start_loc: torch.Tensor,  # [S + 1] int32, absolute row offsets into q / out
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [Nq, H, D]
    *,
    config: PrefillConfig | None = None,  # launch config override (tuning)
    block_m: int | None = None,  # tile overrides of the default config (tests); powers of two, >= 16
    tile_n: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's K and V scales
) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its paged keys. Returns `out` [Nq, H, D].

    Only rows [query_start_loc[0], query_start_loc[-1]) of `out` are written.
    Never reads the device to plan: the grid is sized by the host int `max_query_len`.
    """
    num_q, num_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [blocks, block_size, kv_heads, head_dim]: "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != q head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError("query_start_loc must have num_seqs + 1 entries and block_tables num_seqs rows")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} != q {tuple(q.shape)}")
    if num_seqs == 0 or max_query_len <= 0 or num_q == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if k_cache.dtype != torch.float8_e4m3fn:
        # The scales are an fp8 cache's only (reference.from_cache): a 16/32-bit cache holds K and V
        # as they are, even when the checkpoint carried calibrated k_scale / v_scale.
        kv_scales = (1.0, 1.0)
    cfg = config or prefill_config(group_pad, head_dim, max_query_len, q.dtype, device_arch(q.device))
    if block_m or tile_n:
        bm = block_m or cfg.block_m
        cfg = PrefillConfig(bm, tile_n or cfg.tile_n, 8 if bm >= 128 else 4, cfg.num_stages)
    if cfg.block_m < group_pad:
        raise ValueError(f"block_m={cfg.block_m} must be >= the padded GQA group {group_pad}")
    block_q = cfg.block_m // group_pad
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), block_tables.stride(1),
        k_cache.shape[1], float(scale) * _LOG2E * float(kv_scales[0]), float(kv_scales[1]),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        DOT_PRECISION=dot_precision(q.dtype, q.is_cuda),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
