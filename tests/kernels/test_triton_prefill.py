"""Triton KV-cache write and prefill attention against the PyTorch reference.

Without a GPU these run under TRITON_INTERPRET=1 (set by tests/conftest.py
before triton is imported), so shapes are tiny and bf16 is not tested (the
interpreter has none).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.configs import PREFILL_SWEEP, PrefillConfig
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.triton_cache import write_kv
from pdserve.kernels.triton_prefill import prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- write_kv


def _fused_kv(num_tokens: int, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """k, v as non-contiguous slices of a fused qkv projection output [T, (H + 2 KVH) * D]."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q_end, k_end = num_heads * head_dim, (num_heads + kv_heads) * head_dim
    k = qkv[:, q_end:k_end].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, kv_heads, head_dim)
    assert not k.is_contiguous() and not v.is_contiguous()
    return qkv, k, v


def _slots_with_skips(num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens: must not be written anywhere
    return slots.to(DEVICE)


@pytest.mark.parametrize(
    "dtype,num_tokens,num_heads,kv_heads,head_dim,block_size,num_blocks",
    [
        (torch.float32, 23, 4, 2, 32, 8, 6),
        (torch.float16, 17, 8, 1, 64, 16, 3),
        (torch.float32, 9, 6, 3, 128, 5, 4),  # page size not a power of two, odd head count
    ],
)
def test_write_kv_noncontiguous(dtype, num_tokens, num_heads, kv_heads, head_dim, block_size, num_blocks):
    gen = torch.Generator().manual_seed(num_tokens)
    _, k, v = _fused_kv(num_tokens, num_heads, kv_heads, head_dim, dtype, gen)
    # One allocation holds both caches, interleaved per block and with a spare head:
    # neither view is contiguous and neither can be flattened to [slots, KVH, D].
    backing = torch.randn(num_blocks, 2, block_size, kv_heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = _slots_with_skips(num_tokens, num_blocks * block_size, gen)

    expected = backing.clone()
    keep = slots >= 0
    blk, off = slots[keep] // block_size, slots[keep] % block_size
    expected[:, 0, :, :kv_heads][blk, off] = k[keep]
    expected[:, 1, :, 1:][blk, off] = v[keep]

    k_cache, v_cache = backing[:, 0, :, :kv_heads], backing[:, 1, :, 1:]
    assert not k_cache.is_contiguous() and not v_cache.is_contiguous()
    write_kv(k, v, k_cache, v_cache, slots)
    # Bit-exact copy into the target slots; every other element (skipped slots,
    # the spare head, the other cache) untouched.
    assert torch.equal(backing, expected)


def test_write_kv_matches_reference():
    gen = torch.Generator().manual_seed(7)
    num_tokens, num_heads, kv_heads, head_dim, block_size, num_blocks = 30, 4, 2, 64, 16, 4
    _, k, v = _fused_kv(num_tokens, num_heads, kv_heads, head_dim, torch.float16, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).half().to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).half().to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_all_skipped_and_empty():
    k_cache = torch.zeros(2, 4, 1, 32, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 32, device=DEVICE)
    k = torch.ones(3, 1, 32, device=DEVICE)
    write_kv(k, k, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    write_kv(k[:0], k[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


# --------------------------------------------------------------------------- prefill


class _Case:
    """A ragged batch whose keys/values are already in a paged cache.

    Blocks are shuffled; every cache slot that no sequence owns, and every padding
    entry of the block table (which points at a spare block), holds NaN, so a
    kernel that reads past a sequence's keys produces NaN.
    """

    def __init__(self, seqs, num_heads, kv_heads, head_dim, block_size, dtype, q_offset, q_tail, seed):
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size = seqs, block_size
        self.dtype, self.num_heads, self.kv_heads, self.head_dim = dtype, num_heads, kv_heads, head_dim
        lens = [ctx + n for ctx, n in seqs]
        need = [_cdiv(L, block_size) for L in lens]
        num_blocks = sum(need) + 2
        ids = torch.randperm(num_blocks, generator=gen)
        self.poison_block = int(ids[-1])
        max_blocks = max(need) + 2
        tables = torch.full((len(seqs), max_blocks), self.poison_block, dtype=torch.int32)
        used = 0
        for i, nb in enumerate(need):
            tables[i, :nb] = ids[used:used + nb].int()
            used += nb

        # Both caches in one allocation (non-contiguous views), NaN everywhere not written.
        self.backing = torch.full((num_blocks, 2, block_size, kv_heads, head_dim), NAN, dtype=dtype)
        k_cache, v_cache = self.backing[:, 0], self.backing[:, 1]
        q_len_total = sum(n for _, n in seqs)
        self.q = torch.randn(q_offset + q_len_total + q_tail, num_heads, head_dim, generator=gen).to(dtype)
        k_new, v_new = [], []
        for i, L in enumerate(lens):
            k = torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype)
            pos = torch.arange(L)
            blk, off = tables[i, pos // block_size].long(), pos % block_size
            k_cache[blk, off] = k
            v_cache[blk, off] = v
            ctx = seqs[i][0]
            k_new.append(k[ctx:])
            v_new.append(v[ctx:])
        self.k_new, self.v_new = torch.cat(k_new), torch.cat(v_new)
        self.slots = torch.cat([
            tables[i, torch.arange(ctx, ctx + n) // block_size].long() * block_size
            + torch.arange(ctx, ctx + n) % block_size
            for i, (ctx, n) in enumerate(seqs)
        ])
        self.tables = tables
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        starts = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
        self.rel_qsl = torch.from_numpy(starts)
        self.qsl = self.rel_qsl + q_offset  # absolute rows into q / out
        self.q_begin, self.q_end = q_offset, q_offset + q_len_total
        self.max_query_len = max(n for _, n in seqs)
        self.scale = head_dim ** -0.5

    def caches(self):
        return self.backing[:, 0], self.backing[:, 1]

    def to_device(self):
        for name in ("backing", "q", "k_new", "v_new", "slots", "tables", "seq_lens", "qsl"):
            setattr(self, name, getattr(self, name).to(DEVICE))
        return self

    def expected(self) -> torch.Tensor:
        """The reference's prefill path in float64 -> [Nq_chunk, H, D]."""
        meta = AttentionMetadata(
            slot_mapping=self.slots.cpu(),
            block_tables=self.tables.cpu(),  # the reference runs on the CPU, its indices too
            seq_lens=self.seq_lens.cpu(),
            query_start_loc=self.rel_qsl,
            num_decode_seqs=0,  # every sequence takes the reference's prefill path
            seq_lens_np=self.seq_lens.cpu().numpy(),
            query_start_loc_np=self.rel_qsl.numpy(),
            block_size=self.block_size,
        )
        backing = self.backing.cpu().double()  # the reference needs contiguous caches (it views them flat)
        ref = reference.paged_attention(
            self.q[self.q_begin:self.q_end].cpu().double(), self.k_new.cpu().double(), self.v_new.cpu().double(),
            backing[:, 0].contiguous(), backing[:, 1].contiguous(), meta, self.scale,
        )
        return ref.view(-1, self.num_heads, self.head_dim)

    def run(self, out=None, max_query_len=None, **tiles) -> torch.Tensor:
        k_cache, v_cache = self.caches()
        return prefill_attention(
            self.q, k_cache, v_cache, self.tables, self.seq_lens, self.qsl, self.scale,
            max_query_len or self.max_query_len, out=out, **tiles,
        )


def _check(case: _Case, out: torch.Tensor) -> None:
    """Rows of the batch match the float64 reference; rows outside it are still NaN."""
    assert torch.isnan(out[:case.q_begin]).all() and torch.isnan(out[case.q_end:]).all()
    got = out[case.q_begin:case.q_end].cpu()
    assert not torch.isnan(got).any(), "some covered output element was never written"
    ref = case.expected()
    if case.dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=2e-3)


# (context, new tokens) per sequence: no prefix, part of a block, several blocks;
# lengths not multiples of the page; a one-token chunk; an empty one.
PREFILL_CASES = [
    # id, dtype, head_dim, heads, kv_heads, block_size, seqs, q_offset, tiles
    ("mha-d64-fp32", torch.float32, 64, 4, 4, 16, [(0, 37), (5, 20), (40, 9)], 0, {}),
    ("gqa4-d32-fp32-small-tiles", torch.float32, 32, 8, 2, 8, [(0, 13), (3, 1), (19, 30), (16, 7)], 5,
     {"block_m": 16, "tile_n": 16}),
    ("gqa8-d64-fp32", torch.float32, 64, 8, 1, 4, [(0, 1), (11, 25), (33, 3)], 2, {"block_m": 16, "tile_n": 16}),
    ("gqa3-d32-fp32-page6", torch.float32, 32, 6, 2, 6, [(4, 10), (9, 0), (0, 22)], 1, {"block_m": 32, "tile_n": 32}),
    ("gqa4-d64-fp16", torch.float16, 64, 4, 1, 16, [(0, 50), (17, 17)], 0, {}),
    ("gqa2-d32-fp16-page5", torch.float16, 32, 4, 2, 5, [(7, 12), (0, 9), (30, 2)], 3, {"block_m": 16, "tile_n": 16}),
    ("mha-d128-fp32", torch.float32, 128, 2, 2, 16, [(21, 12)], 4, {}),
]


@pytest.mark.parametrize(
    "dtype,head_dim,num_heads,kv_heads,block_size,seqs,q_offset,tiles",
    [pytest.param(*c[1:], id=c[0]) for c in PREFILL_CASES],
)
def test_prefill_matches_reference(dtype, head_dim, num_heads, kv_heads, block_size, seqs, q_offset, tiles):
    case = _Case(seqs, num_heads, kv_heads, head_dim, block_size, dtype, q_offset, q_tail=3,
                 seed=len(seqs) * 100 + head_dim).to_device()
    out = torch.full_like(case.q, NAN)
    ret = case.run(out=out, **tiles)
    assert ret is out
    _check(case, out)


@pytest.mark.parametrize("block_m,tile_n", sorted({(c.block_m, c.tile_n) for c in PREFILL_SWEEP}))
def test_every_tuning_tile_matches_reference(block_m, tile_n):
    """Each (rows, keys) tile the GPU sweep may pick (`bench/kernels_gpu.py --tune`),
    GQA 4, a chunk longer than one program, a chunk behind a cached prefix, a short one."""
    case = _Case([(0, 70), (37, 21), (5, 3)], 8, 2, 32, 16, torch.float32, q_offset=2, q_tail=1,
                 seed=block_m + tile_n).to_device()
    cfg = next(c for c in PREFILL_SWEEP if (c.block_m, c.tile_n) == (block_m, tile_n))
    out = torch.full_like(case.q, NAN)
    case.run(out=out, config=cfg)
    _check(case, out)


def test_prefill_config_rejects_bad_values():
    with pytest.raises(ValueError, match="powers of two"):
        PrefillConfig(block_m=96, tile_n=64, num_warps=8, num_stages=3)
    # 32 query heads on one KV head: a 16-row program cannot hold the group.
    case = _Case([(0, 5)], 32, 1, 32, 16, torch.float32, q_offset=0, q_tail=0, seed=1).to_device()
    with pytest.raises(ValueError, match="GQA group"):
        case.run(config=PrefillConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2))


def test_prefill_allocates_out_and_tolerates_oversized_grid():
    """out=None returns a fresh [Nq, H, D]; a max_query_len above the real one (a
    padded grid) only adds programs that exit at once."""
    case = _Case([(3, 6), (0, 11)], 4, 2, 32, 8, torch.float32, q_offset=0, q_tail=0, seed=3).to_device()
    out = case.run(max_query_len=case.max_query_len + 20, block_m=16, tile_n=16)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    _check(case, out)


def test_write_then_prefill_chunked():
    """The engine's order: Triton write_kv of a chunk's K/V (slices of fused qkv) into a
    cache that already holds the prefix, then Triton prefill; against reference.paged_attention."""
    gen = torch.Generator().manual_seed(11)
    num_heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    seqs = [(10, 7), (0, 12)]  # second chunk of a prompt; a fresh prompt
    case = _Case(seqs, num_heads, kv_heads, head_dim, block_size, torch.float32, q_offset=0, q_tail=0, seed=11)
    num_new = sum(n for _, n in seqs)
    qkv, k, v = _fused_kv(num_new, num_heads, kv_heads, head_dim, torch.float32, gen)
    q = qkv[:, :num_heads * head_dim].view(num_new, num_heads, head_dim)
    case.q, case.k_new, case.v_new = q.cpu(), k.cpu(), v.cpu()
    # Forget the new tokens' K/V the case put in the cache: write_kv must supply them.
    k_cache, v_cache = case.caches()
    blk, off = case.slots // block_size, case.slots % block_size
    k_cache[blk, off] = NAN
    v_cache[blk, off] = NAN
    ref = case.expected()  # reference.paged_attention writes the new K/V itself

    case.to_device()
    k_cache, v_cache = case.caches()
    write_kv(k, v, k_cache, v_cache, case.slots)
    out = prefill_attention(q, k_cache, v_cache, case.tables, case.seq_lens, case.qsl, case.scale, case.max_query_len)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-5)
