"""Edges of fp8 weights and the fp8 KV cache that tests/workers/test_fp8.py does not reach.

Oracles: the PyTorch reference attention (kernels/reference.py) and float64 attention over the
cache's contents; for checkpoints, the weights they hold dequantized (float64) against what the
engine loaded, and the unquantized engine's logits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec

from pdserve import LLM
from pdserve.kernels import reference
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


def _llm(path: Path, **kw: object) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False, **kw)


# -- calibrated KV scales with a 16/32-bit cache ----------------------------------------------------


def _float_cache_case(seed: int = 0) -> dict:
    """A mixed batch (two decode rows, then chunks with and without context) over a float32
    cache whose context slots hold each sequence's earlier K/V as they are."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    seqs = [(5, 1), (12, 1), (9, 3), (0, 6)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 1
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    max_blocks = max(-(-(c + n) // bs) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots = [], [], [], []
    nxt = 0
    for i, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // bs)
        tables[i, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
        keys = torch.randn(c + n, kv_heads, dim, generator=gen)
        values = torch.randn(c + n, kv_heads, dim, generator=gen)
        pos = torch.arange(c + n)
        blk, off = tables[i, pos // bs].long(), pos % bs
        k_cache[blk[:c], off[:c]] = keys[:c]
        v_cache[blk[:c], off[:c]] = values[:c]
        qs.append(torch.randn(n, heads, dim, generator=gen))
        ks.append(keys[c:])
        vs.append(values[c:])
        slots.append(blk[c:] * bs + off[c:])
    lens = np.array([c + n for c, n in seqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables, seq_lens=torch.from_numpy(lens),
                             query_start_loc=torch.from_numpy(qsl), num_decode_seqs=2, seq_lens_np=lens,
                             query_start_loc_np=qsl, block_size=bs)
    return dict(q=torch.cat(qs), k=torch.cat(ks), v=torch.cat(vs), k_cache=k_cache, v_cache=v_cache, meta=meta,
                scale=dim**-0.5)


def test_triton_attention_ignores_kv_scales_over_a_float_cache() -> None:
    """A checkpoint's calibrated k_scale / v_scale (loader.py sets them on every attention layer
    whatever the cache) belong to an fp8 cache only: a 16/32-bit cache stores K and V as they
    are, and the reference reads them so. The Triton decode and prefill kernels multiplied the
    scores by k_scale and the output by v_scale anyway, so a calibrated fp8 checkpoint served
    with `kv_cache_dtype="auto"` on the Triton backend (the CUDA default) attended wrongly."""
    pytest.importorskip("triton")
    from pdserve.kernels import triton_attention

    case = _float_cache_case()
    scales = (0.25, 4.0)
    want = reference.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                     case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=(1.0, 1.0))
    ref_scaled = reference.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                           case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=scales)
    torch.testing.assert_close(ref_scaled, want)  # the reference: scales do not touch a float cache
    got = triton_attention.paged_attention(case["q"], case["k"], case["v"], case["k_cache"].clone(),
                                           case["v_cache"].clone(), case["meta"], case["scale"], kv_scales=scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
