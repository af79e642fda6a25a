"""The PyTorch reference attention (the CPU backend and the Triton kernels'
oracle) against plain float64 attention, token by token, on a mixed batch:
decode rows, short chunks with a cached context (k+1 verification rows, small
prefill tails; these run as one padded batch), and long chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.metadata import AttentionMetadata


def naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions context..context+n-1; keys/values [L, KVH, D]; causal."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(n, heads, q.shape[2], dtype=torch.float64)
    for j in range(n):
        visible = context + j + 1
        for h in range(heads):
            kh, vh = keys[:visible, h // group], values[:visible, h // group]
            w = torch.softmax((kh @ q[j, h]) * scale, dim=0)
            out[j, h] = w @ vh
    return out


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_reference_matches_plain_attention_on_a_mixed_batch(kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, dim, bs = 4, 16, 4
    # (context, new tokens): 3 decode rows, then short chunks (incl. an empty context), then long ones.
    seqs = [(5, 1), (12, 1), (1, 1), (9, 5), (3, 2), (0, 6), (17, 4), (7, 40), (0, 37)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 3
    # Unwritten slots hold a huge value: any key read past a sequence's end with
    # a non-zero weight ruins the result. (Not NaN: the decode path relies on the
    # engine's caches being finite, as they are: zeroed, then written with K/V.)
    k_cache = torch.full((num_blocks, bs, kv_heads, dim), 1e30, dtype=torch.float64)
    v_cache = k_cache.clone()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison = perm.pop()  # padding entries of the block table point here
    max_blocks = max(-(-(c + n) // bs) for c, n in seqs) + 1
    tables = torch.full((len(seqs), max_blocks), poison, dtype=torch.int32)
    qs, ks, vs, slots, full = [], [], [], [], []
    for i, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        keys = torch.randn(c + n, kv_heads, dim, generator=gen, dtype=torch.float64)
        values = torch.randn(c + n, kv_heads, dim, generator=gen, dtype=torch.float64)
        pos = torch.arange(c + n)
        blk, off = tables[i, pos // bs].long(), pos % bs
        k_cache[blk[:c], off[:c]] = keys[:c]  # the context is cached; the new K/V are written by the call
        v_cache[blk[:c], off[:c]] = values[:c]
        qs.append(torch.randn(n, heads, dim, generator=gen, dtype=torch.float64))
        ks.append(keys[c:])
        vs.append(values[c:])
        slots.append(blk[c:] * bs + off[c:])
        full.append((keys, values))
    lens = np.array([c + n for c, n in seqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, seq_lens=torch.from_numpy(lens),
                             query_start_loc=torch.from_numpy(qsl), num_decode_seqs=3, seq_lens_np=lens,
                             query_start_loc_np=qsl, block_size=bs)
    scale = dim ** -0.5
    out = reference.paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale)
    for i, (c, n) in enumerate(seqs):
        want = naive(qs[i], *full[i], c, scale).reshape(n, heads * dim)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], want, rtol=1e-10, atol=1e-10)
