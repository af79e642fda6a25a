"""The CPU decode attention op (pdserve/kernels/cpu_decode.py) against plain float64 attention and the PyTorch
reference: scattered and shared-looking block tables, lengths off block boundaries, GQA groups of
1-4, a padded block table whose padding points at poisoned blocks, float32/float16/bfloat16; and the
cache write it does (the new K/V land in their slots, nothing else moves). Skips where the op cannot
be built (no C++ compiler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import attention, cpu_decode, reference
from pdserve.kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="the CPU decode op could not be built here")


def decode_batch(lens: list[int], heads: int, kv_heads: int, dim: int, bs: int, dtype: torch.dtype,
                 seed: int, rows: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """A decode step: `rows[i]` new tokens (default 1) at the end of sequence i of length lens[i], their
    K/V not yet in the cache; returns q, k, v, caches, the metadata, and each sequence's full
    keys/values in float64 for the oracle."""
    rows = rows or [1] * len(lens)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    k_cache = torch.full((num_blocks, bs, kv_heads, dim), 1e4, dtype=dtype)  # unwritten slots: huge (finite)
    v_cache = k_cache.clone()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison = perm.pop()
    max_blocks = max(-(-n // bs) for n in lens) + 2  # padded: padding points at the poisoned block
    tables = torch.full((len(lens), max_blocks), poison, dtype=torch.int32)
    q = torch.randn(sum(rows), heads, dim, generator=gen, dtype=torch.float64)
    full_k, full_v, new_k, new_v, slots = [], [], [], [], []
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        keys = torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
        values = torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
        pos = torch.arange(n)
        blk, off = tables[i, pos // bs].long(), pos % bs
        c = n - rows[i]
        k_cache[blk[:c], off[:c]] = keys[:c]
        v_cache[blk[:c], off[:c]] = values[:c]
        new_k.append(keys[c:])
        new_v.append(values[c:])
        slots.append(blk[c:] * bs + off[c:])
        full_k.append(keys.double())
        full_v.append(values.double())
    seq_lens = np.array(lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    decode_rows = next((i for i, r in enumerate(rows) if r > 1), len(rows))  # decode rows first, as in a step
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, seq_lens=torch.from_numpy(seq_lens),
                             query_start_loc=torch.from_numpy(qsl), num_decode_seqs=decode_rows, seq_lens_np=seq_lens,
                             query_start_loc_np=qsl, block_size=bs)
    return q.to(dtype), torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, meta, full_k, full_v  # type: ignore[return-value]


def oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    heads, group = q.shape[0], q.shape[0] // keys.shape[1]
    return torch.stack([torch.softmax((keys[:, h // group] @ q[h].double()) * scale, 0) @ values[:, h // group]
                        for h in range(heads)])


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_causal_rows(out: torch.Tensor, q: torch.Tensor, lens: list[int], rows: list[int],
                       full_k: list[torch.Tensor], full_v: list[torch.Tensor], meta: AttentionMetadata, scale: float,
                       dtype: torch.dtype) -> None:
    """Row j of a sequence with r new tokens matches float64 attention over its keys up to its own position."""
    qsl = meta.query_start_loc_np
    for i, (n, r) in enumerate(zip(lens, rows)):
        for j in range(r):
            visible = n - r + j + 1
            want = oracle(q[qsl[i] + j], full_k[i][:visible], full_v[i][:visible], scale).reshape(-1)
            torch.testing.assert_close(out[qsl[i] + j].double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 16), (4, 2, 16), (9, 3, 64), (8, 2, 36)])
def test_the_op_matches_float64_attention_and_writes_the_new_kv(dtype: torch.dtype, heads: int, kv_heads: int,
                                                                 dim: int) -> None:
    lens = [1, 5, 16, 17, 300, 33]  # a lone first token, inside a block, on and just past a boundary, long
    q, k, v, k_cache, v_cache, meta, full_k, full_v = decode_batch(lens, heads, kv_heads, dim, 16, dtype, seed=dim)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    scale = dim ** -0.5
    out = cpu_decode.paged_decode(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == (len(lens), heads * dim) and out.dtype == dtype
    for i in range(len(lens)):
        want = oracle(q[i], full_k[i], full_v[i], scale).reshape(-1)
        torch.testing.assert_close(out[i].double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):  # the new slots, and only them
        expected = before.clone()
        expected.view(-1, kv_heads, dim)[meta.slot_mapping] = new
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("lens", [[300], [40, 300], [5, 16, 17, 300, 33]])
def test_per_head_tasks_when_sequences_are_fewer_than_threads_give_the_same_result(lens: list[int]) -> None:
    """The op splits a sequence's KV heads into tasks of their own when there are fewer sequences
    than threads; whatever the split, every row matches float64 and the thread counts agree."""
    dtype, heads, kv_heads, dim = torch.bfloat16, 9, 3, 64
    outs = []
    was = torch.get_num_threads()
    try:
        for threads in (1, 4):  # 4 > every batch here but the last: the split path
            torch.set_num_threads(threads)
            q, k, v, k_cache, v_cache, meta, full_k, full_v = decode_batch(lens, heads, kv_heads, dim, 16, dtype,
                                                                           seed=7)
            outs.append(cpu_decode.paged_decode(q, k, v, k_cache, v_cache, meta, dim ** -0.5))
    finally:
        torch.set_num_threads(was)
    assert torch.equal(outs[0], outs[1])
    for i in range(len(lens)):
        want = oracle(q[i], full_k[i], full_v[i], dim ** -0.5).reshape(-1)
        torch.testing.assert_close(outs[1][i].double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])  # the head dims compiled as constants (16 keys' dots summed at once)
@pytest.mark.parametrize("bs", [8, 32])  # blocks shorter and longer than those 16 keys
def test_unrolled_head_dims_match_float64_at_other_block_sizes_and_with_verification_rows(
        dtype: torch.dtype, dim: int, bs: int) -> None:
    lens, rows = [1, 7, 8, 9, 33, 70, 200], [1, 1, 1, 1, 4, 1, 8]
    q, k, v, k_cache, v_cache, meta, full_k, full_v = decode_batch(lens, 8, 2, dim, bs, dtype, seed=dim + bs,
                                                                   rows=rows)
    assert cpu_decode.usable(q, k_cache, meta)
    scale = dim ** -0.5
    out = cpu_decode.paged_decode(q, k, v, k_cache, v_cache, meta, scale)
    assert_causal_rows(out, q, lens, rows, full_k, full_v, meta, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_rows_see_their_own_prefix_only(dtype: torch.dtype) -> None:
    """A verification step: a decode row, then sequences with k+1 new tokens (one with no context
    before them); row j of a sequence sees its keys up to its own position."""
    lens, rows = [40, 21, 5, 64], [1, 5, 5, 8]
    q, k, v, k_cache, v_cache, meta, full_k, full_v = decode_batch(lens, 8, 2, 32, 16, dtype, seed=11, rows=rows)
    assert cpu_decode.usable(q, k_cache, meta)
    scale = 32 ** -0.5
    out = cpu_decode.paged_decode(q, k, v, k_cache, v_cache, meta, scale)
    assert_causal_rows(out, q, lens, rows, full_k, full_v, meta, scale, dtype)
    long_chunk = decode_batch([80], 8, 2, 32, 16, dtype, seed=12, rows=[cpu_decode.MAX_ROWS + 1])
    assert not cpu_decode.usable(long_chunk[0], long_chunk[3], long_chunk[5])  # a prefill chunk: the reference


def test_the_op_agrees_with_the_reference_and_the_dispatch_takes_it() -> None:
    lens = [40, 7, 129]
    q, k, v, k_cache, v_cache, meta, _, _ = decode_batch(lens, 8, 2, 32, 16, torch.float32, seed=3)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = reference.paged_attention(q, k, v, ref_k, ref_v, meta, 0.2)
    got = attention.paged_attention(q, k, v, k_cache, v_cache, meta, 0.2)  # the CPU backend's dispatch
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert cpu_decode.usable(q, k_cache, meta)
    assert not cpu_decode.usable(q.double(), k_cache.double(), meta)  # a dtype the op has no loop for


def test_turned_off_by_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, k_cache, v_cache, meta, _, _ = decode_batch([9], 4, 2, 16, 4, torch.float32, seed=5)
    assert cpu_decode.load() is not None  # built already in this process: the switch still holds
    monkeypatch.setenv(cpu_decode.ENV, "0")
    assert not cpu_decode.enabled() and cpu_decode.load() is None
    assert not cpu_decode.usable(q, k_cache, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_sends_its_decode_rows_to_the_op_and_matches_float64(dtype: torch.dtype,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A served step: decode rows first, then prefill chunks longer than the op takes. The decode
    rows go through the op, the chunks through the reference; every row matches float64 attention
    over its own prefix, and the cache holds every new K/V."""
    lens, rows = [40, 21, 130, 64, 50], [1, 1, 1, 40, cpu_decode.MAX_ROWS + 3]
    q, k, v, k_cache, v_cache, meta, full_k, full_v = decode_batch(lens, 8, 2, 32, 16, dtype, seed=13, rows=rows)
    assert meta.num_decode_seqs == 3 and not cpu_decode.usable(q, k_cache, meta)
    assert cpu_decode.usable_for_decode_rows(q, k_cache, meta)
    calls: list[int] = []
    real = cpu_decode.decode_rows

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_decode, "decode_rows", counted)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    scale = 32 ** -0.5
    out = attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    assert calls, "the decode rows did not take the op"
    assert_causal_rows(out, q, lens, rows, full_k, full_v, meta, scale, dtype)
    for cache, before, new in ((k_cache, before_k, k), (v_cache, before_v, v)):
        expected = before.clone()
        expected.view(-1, 2, 32)[meta.slot_mapping] = new
        assert torch.equal(cache, expected)
