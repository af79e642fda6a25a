"""PyTorch reference attention over the paged KV cache.

This is the backend on CPU and the oracle the Triton kernels are tested
against. Layout (shared with the kernels and the KV transport):
k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels.metadata import AttentionMetadata

# The fp8 KV cache's format (vLLM's `--kv-cache-dtype fp8`): e4m3, a float scale per layer for K
# and one for V; the value stored is x / scale, clamped to the format's range (a cast past it is NaN).
FP8_KV = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV).max)
UNIT_SCALES = (1.0, 1.0)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` as the cache stores it: as it is, or quantized to the fp8 cache's scale."""
    if cache.dtype != FP8_KV:
        return x
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)  # times the inverse: as the kernels


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache contents in `dtype`: as they are, or an fp8 cache's dequantized."""
    if x.dtype != FP8_KV:
        return x
    return x.to(dtype) * scale if scale != 1.0 else x.to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = UNIT_SCALES) -> None:
    """Scatter new keys/values [T, KVH, D] into their cache slots (quantized in an fp8 cache)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for cache, x, scale in ((k_cache, k, kv_scales[0]), (v_cache, v, kv_scales[1])):
        stored = to_cache(x, cache, scale)
        if cache.dtype == FP8_KV:  # index_copy_ has no fp8 kernel on a CPU: copy the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.view(num_slots, *cache.shape[2:]).index_copy_(0, slot_mapping, stored)


# decode(q, k, v, k_cache, v_cache, meta, scale) -> [num_decode_seqs, H * D]: the attention of a
# step's first meta.num_decode_seqs rows (one new token each, already written to the cache).
DecodeRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float],
                      torch.Tensor]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] new keys (RoPE applied)
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeRows | None = None,
    kv_scales: tuple[float, float] = UNIT_SCALES,
) -> torch.Tensor:  # [T, H * D]
    """Write the new K/V into the cache, then attend causally over each sequence.
    `decode`: what computes the one-token rows of a mixed step (default: this module's).
    `kv_scales`: an fp8 cache's K and V scales (`to_cache`); attention reads what the cache
    holds, dequantized (a chunk with no context attends its own K/V as computed)."""
    if meta.padded:  # padding rows (slot -1) write nothing
        keep = meta.slot_mapping >= 0
        write_kv(k[keep], v[keep], k_cache, v_cache, meta.slot_mapping[keep], kv_scales)
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    nd = meta.num_decode_seqs
    if nd == meta.num_seqs:  # pure decode step: no output buffer to assemble
        return _decode(q, k_cache, v_cache, meta, scale, kv_scales)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = (decode(q, k, v, k_cache, v_cache, meta, scale) if decode is not None
                    else _decode(q[:nd], k_cache, v_cache, meta, scale, kv_scales))
    qsl = meta.query_start_loc_np
    # Short chunks (verifying k+1 drafted tokens, small prefill tails) go in one
    # padded batch: one SDPA call per layer instead of one per sequence.
    short = [i for i in range(nd, meta.num_seqs) if qsl[i + 1] - qsl[i] <= _SHORT_CHUNK]
    if len(short) > 1:
        _short_chunks(q, k_cache, v_cache, meta, short, scale, out, kv_scales)
    else:
        short = []
    for i in range(nd, meta.num_seqs):
        if short and i in short:
            continue
        start, end = int(qsl[i]), int(qsl[i + 1])
        out[start:end] = _prefill_one(q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta, i, scale,
                                      kv_scales)
    return out


_SHORT_CHUNK = 32  # new tokens; longer chunks run one by one (padding would waste more than it saves)


def _short_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  seqs: list[int], scale: float, out: torch.Tensor,
                  kv_scales: tuple[float, float] = UNIT_SCALES) -> None:
    """Several sequences with a few new tokens each (already in the cache):
    pad them to the longest, gather each one's blocks, one masked SDPA. Query j
    of sequence s sees keys [0, context_s + j]."""
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    idx = torch.tensor(seqs, dtype=torch.long)
    starts = torch.from_numpy(qsl[seqs].astype("int64"))
    n = torch.from_numpy((qsl[[i + 1 for i in seqs]] - qsl[seqs]).astype("int64"))
    lens = torch.from_numpy(seq_lens[seqs].astype("int64"))
    num, m = len(seqs), int(n.max())
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    max_blocks = -(-int(lens.max()) // meta.block_size)
    length = max_blocks * meta.block_size
    blocks = meta.block_tables[idx.to(meta.block_tables.device), :max_blocks].reshape(-1).long()
    nb = k_cache.shape[0]
    kk = from_cache(k_cache.view(nb, -1).index_select(0, blocks), q.dtype, kv_scales[0])
    vv = from_cache(v_cache.view(nb, -1).index_select(0, blocks), q.dtype, kv_scales[1])
    kk, vv = kk.view(num, length, kv_heads, head_dim), vv.view(num, length, kv_heads, head_dim)
    # Slots past a sequence's end (its padding blocks) may hold anything, NaN
    # included, and NaN * 0 is NaN: zero them rather than trust the mask alone.
    beyond = (torch.arange(length)[None, :] >= lens[:, None]).to(q.device)[:, :, None, None]
    kk = kk.masked_fill(beyond, 0.0).transpose(1, 2)
    vv = vv.masked_fill(beyond, 0.0).transpose(1, 2)
    j = torch.arange(m)
    valid = j[None, :] < n[:, None]  # [num, m]
    rows = (starts[:, None] + j[None, :]).masked_fill(~valid, 0).to(q.device)  # padding reads row 0, ignored
    qp = q[rows.reshape(-1)].view(num, m, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qq = qp.reshape(num, kv_heads, m * group, head_dim)
    limit = (lens - n)[:, None] + j[None, :] + 1  # keys visible to query j: [0, context + j]
    keys = torch.arange(length)
    visible = (keys[None, None, :] < limit[:, :, None]).to(q.device)  # [num, m, L]
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    mask = mask.repeat_interleave(group, dim=1).view(num, 1, m * group, length)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)  # [num, KVH, m*G, D]
    o = o.view(num, kv_heads, m, group, head_dim).permute(0, 2, 1, 3, 4).reshape(num, m, num_heads * head_dim)
    out[rows[valid]] = o[valid.to(q.device)]


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float, kv_scales: tuple[float, float] = UNIT_SCALES) -> torch.Tensor:
    """One query per sequence: gather each sequence's blocks and run masked SDPA."""
    nd, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    plan = meta.scratch.get("torch_decode")
    if plan is None:
        # Shared by every layer of this step: gather indices and the length mask.
        max_blocks = -(-int(meta.seq_lens_np[:nd].max()) // meta.block_size)
        blocks = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
        keys = torch.arange(max_blocks * meta.block_size, device=q.device)
        # Additive float mask, built once: a boolean one is converted in every call. A padding
        # row (seq_len 0, CUDA-graph buckets) sees key 0 of its table instead of nothing: finite.
        valid = keys[None, :] < meta.seq_lens[:nd, None].clamp(min=1)
        mask = (torch.zeros(valid.shape, dtype=q.dtype, device=q.device)
                .masked_fill_(~valid, float("-inf")).view(nd, 1, 1, -1))
        plan = meta.scratch["torch_decode"] = (blocks, mask)
    blocks, mask = plan
    length = mask.shape[-1]
    # index_select over whole blocks (rows of a 2-D view) is the cheapest gather
    # on CPU. [nd * blocks, bs * KVH * D] -> [nd, KVH, L, D]
    num_blocks = k_cache.shape[0]
    kk = from_cache(k_cache.view(num_blocks, -1).index_select(0, blocks), q.dtype, kv_scales[0])
    vv = from_cache(v_cache.view(num_blocks, -1).index_select(0, blocks), q.dtype, kv_scales[1])
    kk = kk.view(nd, length, kv_heads, head_dim).transpose(1, 2)
    vv = vv.view(nd, length, kv_heads, head_dim).transpose(1, 2)
    # GQA: the query heads of one KV head form that head's "query length" axis.
    qq = q.view(nd, kv_heads, num_heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    return o.reshape(nd, num_heads * head_dim)


def _prefill_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, i: int, scale: float, kv_scales: tuple[float, float] = UNIT_SCALES,
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    seq_len = int(meta.seq_lens_np[i])
    context = seq_len - n
    qq = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if context == 0 and k_cache.dtype != FP8_KV:
        # Nothing cached before this chunk: attend to the fresh K/V directly (an fp8 cache's
        # chunk reads what it stored, as the Triton kernel does, so both see the same values).
        kk, vv = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
    else:
        blocks = -(-seq_len // meta.block_size)
        table = meta.block_tables[i, :blocks].long()
        kk = from_cache(k_cache[table].flatten(0, 1)[:seq_len], q.dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)
        vv = from_cache(v_cache[table].flatten(0, 1)[:seq_len], q.dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(context, seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, num_heads * head_dim)


def rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin of `triton_norm.fused_add_rms_norm`: (normed, new_residual).

    new_residual = x + residual (x when None); normalised in float32, cast to
    x.dtype before the weight multiply (transformers' order), product rounded
    once to x.dtype.
    """
    h = x if residual is None else x + residual
    h32 = h.float()
    normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype), h


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch twin of `triton_rope.apply_rope`: neox half-split rotation of
    x [T, NH, D] by half tables cos/sin [P, D/2] at positions [T], in float32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c = cos[positions].float().unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].float().unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
