"""Paged decode attention in Triton: GQA-packed, split-KV, graph-safe.

Serves decode (one new token per sequence) and speculative verification
(up to `max_query_len` new tokens per sequence, causal among themselves).

Design (see shared/design/research-kernels-and-spec-decoding.md, section 2):

* Stage 1, grid ``(S, num_kv_heads, num_splits)``. One program takes one KV
  head of one sequence and packs ALL its query heads (the GQA group) for all
  of the sequence's query rows (up to `max_query_len`) into the M dimension of
  ``tl.dot``: row ``m`` is query row ``m // GROUP``, head ``m % GROUP`` of the
  group; M is padded to a power of two >= 16. Each K/V tile is therefore read
  once per KV head. The program walks a contiguous range of KV tiles of
  ``TILE_N`` tokens (independent of the page size: each token's page is
  gathered as ``block_tables[s, pos // block_size]``) with an online softmax
  in fp32 (``exp2``, ``scale * log2(e)`` folded in), and writes its partial
  result (acc normalised by its own sum, and its log2-sum-exp) to an fp32
  workspace. The split ranges are computed on the device from
  ``seq_lens[s]``; a split past the sequence's end writes ``lse = -inf`` and
  ``acc = 0``.
* Stage 2, grid ``(S, max_query_len, H)``: merges the splits of each
  (row, head) with log-sum-exp weights and writes the output in q's dtype.
  With one split, stage 1 writes the output directly and stage 2 is skipped.

Nothing here reads a device tensor on the host: grids and the workspace are
sized from capacities (``len(seq_lens)``, ``block_tables.shape[1]``,
``max_query_len``), so the launch is CUDA-graph capturable. All pointer
offsets are int64.

Layout: k_cache / v_cache ``[num_blocks, block_size, num_kv_heads, head_dim]``,
any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.configs import DecodeConfig, decode_config

_LOG2E = 1.4426950408889634

# Tile (KV tokens per loop iteration) that choose_num_splits assumes by default.
TILE_N = 32
# Upper bound on KV splits per (sequence, KV head).
MAX_SPLITS = 16
# Programs to aim for when choosing the split count (about one wave on H100).
_DEFAULT_TARGET_PROGRAMS = 132

_sm_count_cache: dict[int, int] = {}


def block_m_for(max_query_len: int, group: int) -> int:
    """Rows of stage 1's dot: all query rows x the GQA group, padded to a power of two >= 16."""
    return max(16, int(triton.next_power_of_2(max_query_len * group)))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 must match an fp32 reference: full-precision dots, not TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_TARGET_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count_cache:
        _sm_count_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count_cache[index]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      device: torch.device | None = None, tile_n: int = TILE_N) -> int:
    """KV splits from capacities only (never from current lengths): enough
    programs to fill the GPU, at most MAX_SPLITS, at most one per KV tile of a
    full-capacity sequence."""
    target = _target_programs(device) if device is not None else _DEFAULT_TARGET_PROGRAMS
    max_tiles = max(1, -(-(max_blocks * block_size) // tile_n))
    want = -(-target // max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, max_tiles))


@triton.jit
def _decode_stage1(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, ws_acc_ptr, ws_lse_ptr,
    stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_on, stride_oh, stride_od,
    qk_scale,  # scale * log2(e), times an fp8 cache's K scale
    v_scale,  # an fp8 cache's V scale (1.0 otherwise)
    block_size,
    GROUP: tl.constexpr,
    MAX_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start.to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context = seq_len - q_len

    # Packed rows: m -> (query row, head within the group).
    offs_m = tl.arange(0, BLOCK_M)
    q_row = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_valid = (offs_m < MAX_Q * GROUP) & (q_row < q_len)
    # Causal limit (exclusive) of each packed row.
    limit = tl.where(row_valid, context + q_row + 1, 0)

    offs_d = tl.arange(0, HEAD_DIM)
    q_off = (q_start + q_row.to(tl.int64)) * stride_qn + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=row_valid[:, None], other=0.0)

    # This split's contiguous range of KV tiles, from the device-side length.
    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    offs_n = tl.arange(0, TILE)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    for t in range(tile_lo, tile_hi):
        pos = t * TILE + offs_n
        in_seq = pos < seq_len
        block = tl.load(bt_row + (pos // block_size).to(tl.int64) * stride_btb, mask=in_seq, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        k_off = block * stride_kb + slot * stride_kt + k_head
        v_off = block * stride_vb + slot * stride_vt + v_head
        # (An fp8 cache's values widen to q's dtype here; their scales are applied outside the loop.)
        k = tl.load(k_ptr + k_off[None, :] + offs_d[:, None].to(tl.int64) * stride_kd,
                    mask=in_seq[None, :], other=0.0).to(q.dtype)  # [D, TILE]
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :].to(tl.int64) * stride_vd,
                    mask=in_seq[:, None], other=0.0).to(q.dtype)  # [TILE, D]

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no valid key yet keeps m = -inf: subtract 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    acc = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    if NUM_SPLITS == 1:
        o_off = (q_start + q_row.to(tl.int64)) * stride_on + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :].to(tl.int64) * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Workspace rows are (seq, query row): [S * MAX_Q, H, NUM_SPLITS(, D)], contiguous.
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        ws_row = (seq.to(tl.int64) * MAX_Q + q_row.to(tl.int64)) * num_heads + head.to(tl.int64)
        ws_idx = ws_row * NUM_SPLITS + split
        tl.store(ws_lse_ptr + ws_idx, lse, mask=row_valid)
        tl.store(ws_acc_ptr + ws_idx[:, None] * HEAD_DIM + offs_d[None, :].to(tl.int64), acc,
                 mask=row_valid[:, None])


@triton.jit
def _decode_stage2(
    ws_acc_ptr, ws_lse_ptr, qsl_ptr, out_ptr,
    stride_on, stride_oh, stride_od,
    MAX_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    q_row = tl.program_id(1)
    head = tl.program_id(2)
    num_heads = tl.num_programs(2)

    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start.to(tl.int32)
    if q_row < q_len:
        offs_s = tl.arange(0, SPLITS_P2)
        offs_d = tl.arange(0, HEAD_DIM)
        s_valid = offs_s < NUM_SPLITS
        base = ((seq.to(tl.int64) * MAX_Q + q_row) * num_heads + head) * NUM_SPLITS
        lse = tl.load(ws_lse_ptr + base + offs_s, mask=s_valid, other=float("-inf"))
        acc = tl.load(ws_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_valid[:, None], other=0.0)
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        w_sum = tl.sum(w, 0)
        o = tl.sum(w[:, None] * acc, 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
        o_off = (q_start + q_row) * stride_on + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_off + offs_d.to(tl.int64) * stride_od, o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    *,
    config: DecodeConfig | None = None,  # launch config override (tuning, tests)
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an fp8 cache's K and V scales
) -> torch.Tensor:
    """Attention of each sequence's new query rows over its paged KV cache.

    q: [Nq, H, D]; sequence i owns rows q[query_start_loc[i]:query_start_loc[i+1]]
    (absolute offsets; the first need not be 0). seq_lens[i] counts the cached
    tokens including the new ones (already written). Query row j of a sequence
    with n rows attends keys [0, seq_lens[i] - n + j]. GQA: head h reads KV head
    h // (H // KVH). Returns (or fills `out`, rows outside the sequences'
    ranges untouched) [Nq, H, D] in q's dtype. No host reads of device tensors.
    """
    num_q, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and cache ({kv_dim}) differ")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"cache dtypes must be q's or float8_e4m3fn: q {q.dtype}, k_cache {k_cache.dtype}, "
                         f"v_cache {v_cache.dtype}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_seqs == 0 or num_q == 0:
        return out

    cfg = config or decode_config(head_dim, q.dtype)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_tables.shape[1], block_size, q.device,
                                       tile_n=cfg.tile_n)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    block_m = block_m_for(max_query_len, group)
    if k_cache.dtype != torch.float8_e4m3fn:
        # The scales are an fp8 cache's only (reference.from_cache): a 16/32-bit cache holds K and V
        # as they are, even when the checkpoint carried calibrated k_scale / v_scale.
        kv_scales = (1.0, 1.0)

    if num_splits > 1:
        rows = num_seqs * max_query_len
        ws_acc = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        ws_lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_lse = out  # unused

    _decode_stage1[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, ws_acc, ws_lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        float(scale) * _LOG2E * float(kv_scales[0]), float(kv_scales[1]),
        block_size,
        GROUP=group, MAX_Q=max_query_len, BLOCK_M=block_m, HEAD_DIM=head_dim, TILE=cfg.tile_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _decode_stage2[(num_seqs, max_query_len, num_heads)](
            ws_acc, ws_lse, query_start_loc, out, *out.stride(),
            MAX_Q=max_query_len, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim <= 64 else 8, num_stages=1,
        )
    return out


__all__ = ["paged_decode_attention", "choose_num_splits", "TILE_N", "MAX_SPLITS"]
