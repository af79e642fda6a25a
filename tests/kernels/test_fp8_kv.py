"""The fp8 KV cache (`kv_cache_dtype="fp8"`): e4m3 K and V, each layer's scaled by its own
k_scale / v_scale (pdserve/kernels/reference.py `to_cache`). The oracle is float64 attention over what
the cache holds, dequantized; the PyTorch reference and the Triton kernels (interpreter on a
CPU) must both compute it, and the Triton writes must store the reference's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_reference import naive

from pdserve.kernels import reference
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.reference import FP8_KV, from_cache, to_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = (0.5, 2.0)


def _case(seed: int = 0) -> dict:
    """A mixed batch (decode rows, short chunks, a long chunk with context, one with none) over
    an fp8 cache whose context slots hold each sequence's earlier K/V, quantized."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    seqs = [(5, 1), (12, 1), (9, 3), (3, 2), (7, 20), (0, 9)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 2
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim, dtype=FP8_KV)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-(c + n) // bs) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, held = [], [], [], [], []
    for i, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        # Scaled past e4m3's range at a few entries: they must saturate (448 x scale), not turn NaN.
        keys = torch.randn(c + n, kv_heads, dim, generator=gen) * 3
        values = torch.randn(c + n, kv_heads, dim, generator=gen)
        keys[0, 0, 0] = 1e4
        pos = torch.arange(c + n)
        blk, off = tables[i, pos // bs].long(), pos % bs
        k_cache[blk[:c], off[:c]] = to_cache(keys[:c], k_cache, SCALES[0])
        v_cache[blk[:c], off[:c]] = to_cache(values[:c], v_cache, SCALES[1])
        qs.append(torch.randn(n, heads, dim, generator=gen))
        ks.append(keys[c:])
        vs.append(values[c:])
        slots.append(blk[c:] * bs + off[c:])
        # What the cache holds for every position, dequantized (float64 for the oracle).
        held.append((from_cache(to_cache(keys, k_cache, SCALES[0]), torch.float64, SCALES[0]),
                     from_cache(to_cache(values, v_cache, SCALES[1]), torch.float64, SCALES[1])))
    lens = np.array([c + n for c, n in seqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, seq_lens=torch.from_numpy(lens),
                             query_start_loc=torch.from_numpy(qsl), num_decode_seqs=2, seq_lens_np=lens,
                             query_start_loc_np=qsl, block_size=bs)
    return dict(seqs=seqs, q=torch.cat(qs), k=torch.cat(ks), v=torch.cat(vs), qs=qs, k_cache=k_cache,
                v_cache=v_cache, meta=meta, held=held, qsl=qsl, scale=dim**-0.5)


def _check(case: dict, out: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all()
    for i, (c, n) in enumerate(case["seqs"]):
        want = naive(case["qs"][i].double(), *case["held"][i], c, case["scale"]).reshape(n, -1)
        got = out[case["qsl"][i] : case["qsl"][i + 1]].double()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_to_cache_saturates_and_round_trips_within_e4m3() -> None:
    x = torch.tensor([0.0, 0.3, -1.7, 900.0, -1e6, 5e-4])
    cache = torch.empty(0, dtype=FP8_KV)
    back = from_cache(to_cache(x, cache, 2.0), torch.float32, 2.0)
    assert torch.isfinite(back).all()
    assert back[3] == 896.0 and back[4] == -896.0  # 448 x 2: the largest value the scaled format holds
    ok = x.abs() < 896
    assert ((back - x).abs()[ok] <= x.abs()[ok] * 2**-4 + 2.0 * 2**-9).all()
    # A 16/32-bit cache stores as it is.
    assert to_cache(x, torch.empty(0), 2.0) is x


def test_the_reference_attends_what_the_fp8_cache_holds() -> None:
    case = _case()
    out = reference.paged_attention(case["q"], case["k"], case["v"], case["k_cache"], case["v_cache"],
                                     case["meta"], case["scale"], kv_scales=SCALES)
    _check(case, out, 1e-5)


def test_the_triton_kernels_attend_what_the_fp8_cache_holds() -> None:
    from pdserve.kernels import triton_attention

    case = _case(seed=1)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    meta = case["meta"]
    meta_dev = AttentionMetadata(slot_mapping=meta.slot_mapping.to(DEVICE), block_tables=meta.block_tables.to(DEVICE),
                                 seq_lens=meta.seq_lens.to(DEVICE), query_start_loc=meta.query_start_loc.to(DEVICE),
                                 num_decode_seqs=meta.num_decode_seqs, seq_lens_np=meta.seq_lens_np,
                                 query_start_loc_np=meta.query_start_loc_np, block_size=meta.block_size)
    ref_k, ref_v = case["k_cache"].clone(), case["v_cache"].clone()
    out = triton_attention.paged_attention(dev["q"], dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], meta_dev,
                                           case["scale"], SCALES)
    _check(case, out.cpu(), 1e-4)
    # The kernel wrote the new K/V as the reference does, byte for byte.
    reference.write_kv(case["k"], case["v"], ref_k, ref_v, meta.slot_mapping, SCALES)
    assert torch.equal(dev["k_cache"].cpu().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(dev["v_cache"].cpu().view(torch.uint8), ref_v.view(torch.uint8))


def test_the_fused_rope_write_stores_the_references_fp8_bytes() -> None:
    from pdserve.kernels.triton_rope import apply_rope, rope_cos_sin
    from pdserve.kernels.triton_rope_cache import rope_and_write_kv
    from pdserve.workers.model.config import RopeConfig, rope_inv_freq

    T, H, KVH, D, blocks, bs = 6, 4, 2, 16, 4, 4
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=gen) * 4).to(DEVICE)
    positions = torch.arange(3, 3 + T).to(DEVICE)
    slots = torch.tensor([0, 5, -1, 9, 14, 2]).to(DEVICE)
    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(), D).to(DEVICE), 32, torch.float32)
    want_k = torch.zeros(blocks, bs, KVH, D, dtype=FP8_KV, device=DEVICE)
    want_v = torch.zeros_like(want_k)
    qk = apply_rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), positions, cos, sin)
    keep = slots >= 0
    reference.write_kv(qk[:, H:][keep], qkv[:, (H + KVH) * D :].reshape(T, KVH, D)[keep], want_k, want_v,
                       slots[keep], SCALES)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    q = rope_and_write_kv(qkv, H, KVH, positions, cos, sin, got_k, got_v, slots, SCALES)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernels_refuse_a_cache_of_another_dtype(dtype: torch.dtype) -> None:
    from pdserve.kernels.triton_decode import paged_decode_attention

    q = torch.zeros(1, 2, 16, dtype=dtype, device=DEVICE)
    other = torch.float16 if dtype is torch.float32 else torch.float32
    cache = torch.zeros(2, 4, 1, 16, dtype=other, device=DEVICE)
    ones = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        paged_decode_attention(q, cache, cache, ones[None], ones, torch.tensor([0, 1], dtype=torch.int32,
                                                                               device=DEVICE), 1.0, 1)
