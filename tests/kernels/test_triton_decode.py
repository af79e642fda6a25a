"""Triton paged decode attention (pdserve/kernels/triton_decode.py) against the PyTorch reference.

Without a GPU these run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny and there is no bf16. The oracle
is `reference.paged_attention` in float64, fed the same cache through an
AttentionMetadata; its multi-row (prefill-chunk) path covers the causal
speculative-verification rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels import reference
from pdserve.kernels.configs import DECODE_SWEEP, DecodeConfig, decode_config
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.triton_decode import MAX_SPLITS, TILE_N, choose_num_splits, paged_decode_attention

# On a GPU machine the same tests run compiled on the device (conftest only
# switches the interpreter on without CUDA).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-4
FP16_TOL = 2e-3


def _make_case(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    layout: str = "contiguous",  # contiguous | engine | interleaved
    row_offset: int = 0,
    extra_rows: int = 0,
    capacity_blocks: int | None = None,
    seed: int = 0,
) -> dict:
    """Random cache with shuffled block ids; padding entries of the block table
    point at a NaN-filled block, and slots past each sequence's end hold NaN, so
    any read beyond seq_len poisons the output."""
    g = torch.Generator().manual_seed(seed)
    assert len(seq_lens) == len(q_lens) and all(n <= L for L, n in zip(seq_lens, q_lens))
    need = [-(-L // block_size) for L in seq_lens]
    capacity = capacity_blocks or max(max(need), 1) + 1
    num_blocks = sum(need) + 2  # + the poison block + one spare
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _empty_caches(shape, dtype, layout)
    k_cache.copy_(torch.randn(shape, generator=g).to(dtype))
    v_cache.copy_(torch.randn(shape, generator=g).to(dtype))

    perm = torch.randperm(num_blocks, generator=g).tolist()
    poison = perm.pop()
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    block_tables = torch.full((len(seq_lens), capacity), poison, dtype=torch.int32)
    for i, (L, nb) in enumerate(zip(seq_lens, need)):
        ids = [perm.pop() for _ in range(nb)]
        block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        if nb:  # stale slots past the end of the last block
            tail = L - (nb - 1) * block_size
            k_cache[ids[-1], tail:] = float("nan")
            v_cache[ids[-1], tail:] = float("nan")

    total_rows = row_offset + sum(q_lens) + extra_rows
    q = torch.randn(total_rows, num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]) + row_offset, dtype=torch.int32)
    return dict(
        q=q.to(DEVICE), k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), query_start_loc=qsl.to(DEVICE),
        seq_lens_list=list(seq_lens), q_lens=list(q_lens), block_size=block_size,
        row_offset=row_offset, scale=head_dim ** -0.5,
    )


def _empty_caches(shape: tuple[int, int, int, int], dtype: torch.dtype,
                  layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised K and V caches of `shape` [NB, bs, KVH, D], laid out as `layout` says."""
    if layout == "contiguous":
        k_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
        v_cache = torch.empty(shape, dtype=dtype, device=DEVICE)
    elif layout == "engine":  # [L, 2, NB, bs, KVH, D], one layer's k/v
        buf = torch.empty(3, 2, *shape, dtype=dtype, device=DEVICE)
        k_cache, v_cache = buf[1, 0], buf[1, 1]
    elif layout == "interleaved":  # [NB, 2, bs, KVH, D]: k/v views with a non-dense block stride
        buf = torch.empty(shape[0], 2, *shape[1:], dtype=dtype, device=DEVICE)
        k_cache, v_cache = buf[:, 0], buf[:, 1]
        assert not k_cache.is_contiguous()
    else:
        raise AssertionError(layout)
    return k_cache, v_cache


def _oracle(case: dict) -> torch.Tensor:
    """reference.paged_attention in float64 over the rows of the case: [rows, H, D]."""
    q_lens, seq_lens, bs = case["q_lens"], case["seq_lens_list"], case["block_size"]
    keep = [i for i, n in enumerate(q_lens) if n > 0]  # graph-padding sequences have no rows
    q_lens = [q_lens[i] for i in keep]
    seq_lens = [seq_lens[i] for i in keep]
    bt = case["block_tables"].cpu()[keep]
    k_cache = torch.nan_to_num(case["k_cache"].cpu().double(), nan=0.0)
    v_cache = torch.nan_to_num(case["v_cache"].cpu().double(), nan=0.0)
    start = case["row_offset"]
    q = case["q"][start:start + sum(q_lens)].cpu().double()
    slots = []
    for i, (L, n) in enumerate(zip(seq_lens, q_lens)):
        for p in range(L - n, L):
            slots.append(int(bt[i, p // bs]) * bs + p % bs)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    num_slots = k_cache.shape[0] * bs
    k_new = k_cache.view(num_slots, *k_cache.shape[2:])[slot_mapping].clone()
    v_new = v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping].clone()
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    qsl_np = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=bt, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.from_numpy(qsl_np), num_decode_seqs=nd,
        seq_lens_np=np.array(seq_lens, dtype=np.int32), query_start_loc_np=qsl_np, block_size=bs,
    )
    out = reference.paged_attention(q, k_new, v_new, k_cache, v_cache, meta, case["scale"])
    return out.view(q.shape)


def _naive(case: dict) -> torch.Tensor:
    """Direct float64 definition, position by position (cross-checks the oracle adapter)."""
    bs, H = case["block_size"], case["q"].shape[1]
    kvh = case["k_cache"].shape[2]
    k_cache, v_cache, bt = case["k_cache"].cpu(), case["v_cache"].cpu(), case["block_tables"].cpu()
    q, qsl = case["q"].cpu(), case["query_start_loc"].cpu()
    rows = []
    for i, (L, n) in enumerate(zip(case["seq_lens_list"], case["q_lens"])):
        keys = torch.stack([k_cache[int(bt[i, p // bs]), p % bs] for p in range(L)]).double()
        vals = torch.stack([v_cache[int(bt[i, p // bs]), p % bs] for p in range(L)]).double()
        for j in range(n):
            qrow = q[int(qsl[i]) + j].double()  # [H, D]
            lim = L - n + j + 1
            kh = keys[:lim].repeat_interleave(H // kvh, dim=1)  # [lim, H, D]
            vh = vals[:lim].repeat_interleave(H // kvh, dim=1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", qrow, kh) * case["scale"], dim=-1)
            rows.append(torch.einsum("hl,lhd->hd", w, vh))
    return torch.stack(rows)


def _run_and_check(case: dict, max_query_len: int, num_splits: int | None, tol: float,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    q = case["q"]
    out = torch.full_like(q, 7.0)
    start = case["row_offset"]
    end = start + sum(case["q_lens"])
    out[start:end] = float("nan")  # every covered element must be written
    res = paged_decode_attention(
        q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], case["query_start_loc"],
        case["scale"], max_query_len, num_splits=num_splits, out=out, config=config,
    )
    assert res is out
    out = out.cpu()
    got = out[start:end]
    assert not torch.isnan(got).any(), "rows left unwritten or NaN leaked from the poisoned cache"
    assert (out[:start] == 7.0).all() and (out[end:] == 7.0).all(), "rows outside the batch slice were written"
    ref = _oracle(case)
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), f"max abs err {err:.3g} vs max|ref| {ref.abs().max().item():.3g}"
    return got


@pytest.mark.parametrize(
    "seq_lens, H, KVH, D, bs, dtype, layout, num_splits",
    [
        ([1, 15, 17, 100], 8, 2, 64, 16, torch.float32, "contiguous", None),
        ([16, 33, 128], 8, 1, 32, 16, torch.float32, "engine", 3),
        ([1, 15, 16, 33], 4, 4, 64, 8, torch.float32, "interleaved", 1),
        ([17, 100, 2], 8, 2, 32, 16, torch.float16, "engine", 3),
        ([33, 1, 64], 8, 8, 64, 5, torch.float16, "contiguous", 1),
    ],
    ids=["fp32-g4-auto", "fp32-g8-split3-engine", "fp32-g1-split1-strided", "fp16-g4-split3", "fp16-g1-bs5"],
)
def test_decode_matches_reference(seq_lens, H, KVH, D, bs, dtype, layout, num_splits):
    case = _make_case(seq_lens, [1] * len(seq_lens), num_heads=H, num_kv_heads=KVH, head_dim=D,
                      block_size=bs, dtype=dtype, layout=layout, seed=len(seq_lens) * 31 + H)
    _run_and_check(case, 1, num_splits, FP32_TOL if dtype == torch.float32 else FP16_TOL)


@pytest.mark.parametrize(
    "seq_lens, q_lens, H, KVH, D, dtype, num_splits",
    [
        ([5, 17, 33, 100], [1, 4, 2, 3], 8, 2, 64, torch.float32, 1),
        ([5, 17, 33, 100], [1, 4, 2, 3], 8, 2, 64, torch.float32, 3),
        ([4, 1, 40, 15], [4, 1, 4, 2], 8, 1, 32, torch.float32, None),
        ([20, 64, 9], [3, 4, 4], 6, 2, 32, torch.float16, 3),
    ],
    ids=["fp32-g4-split1", "fp32-g4-split3", "fp32-g8-auto-nocontext", "fp16-g3-split3"],
)
def test_verification_rows_match_reference(seq_lens, q_lens, H, KVH, D, dtype, num_splits):
    """max_query_len = 4 (k+1 verification): ragged rows per sequence, causal among themselves."""
    case = _make_case(seq_lens, q_lens, num_heads=H, num_kv_heads=KVH, head_dim=D, block_size=16,
                      dtype=dtype, layout="engine", seed=sum(seq_lens))
    _run_and_check(case, 4, num_splits, FP32_TOL if dtype == torch.float32 else FP16_TOL)


# The interpreter ignores warps and stages: one config per tile size covers the sweep's code paths.
_SWEEP_TILES = sorted({c.tile_n for c in DECODE_SWEEP} | {decode_config(64, torch.float16).tile_n})


@pytest.mark.parametrize("tile_n", _SWEEP_TILES)
@pytest.mark.parametrize("max_query_len,num_splits", [(1, None), (4, 3)])
def test_every_tuning_tile_matches_reference(tile_n, max_query_len, num_splits):
    """Each tile size the GPU sweep may pick (`bench/kernels_gpu.py --tune`), with
    sequences shorter than, equal to and longer than one tile, several splits."""
    seq_lens = [3, tile_n, tile_n + 17, 2 * tile_n + 5]
    q_lens = [1] * 4 if max_query_len == 1 else [1, 4, 2, 3]
    case = _make_case(seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.float32, layout="engine", seed=tile_n + max_query_len)
    cfg = next(c for c in DECODE_SWEEP if c.tile_n == tile_n)
    _run_and_check(case, max_query_len, num_splits, FP32_TOL, config=cfg)


def test_decode_config_rejects_bad_values():
    with pytest.raises(ValueError, match="tile_n"):
        DecodeConfig(tile_n=48, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match="num_warps"):
        DecodeConfig(tile_n=64, num_warps=3, num_stages=3)
    with pytest.raises(ValueError, match="num_stages"):
        DecodeConfig(tile_n=64, num_warps=4, num_stages=0)


def test_oracle_agrees_with_naive_definition():
    case = _make_case([5, 17, 3], [1, 4, 3], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                      dtype=torch.float32, seed=3)
    torch.testing.assert_close(_oracle(case), _naive(case), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_batch_slice_with_offset(num_splits):
    """query_start_loc starts at a nonzero row (callers pass a slice of a bigger
    batch): rows before and after the slice stay untouched."""
    case = _make_case([15, 1, 100], [2, 1, 4], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.float32, layout="interleaved", row_offset=5, extra_rows=3, seed=11)
    _run_and_check(case, 4, num_splits, FP32_TOL)


def test_graph_padding_sequences_and_default_out():
    """Padded (empty) sequences at the end of the batch, as a captured graph
    would see them; the block table has spare capacity; out allocated by the op."""
    case = _make_case([33, 7, 0, 0], [1, 1, 0, 0], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.float32, capacity_blocks=8, seed=5)
    res = paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                                 case["query_start_loc"], case["scale"], 1, num_splits=4)
    assert res.shape == case["q"].shape and res.dtype == case["q"].dtype
    assert not torch.isnan(res).any()
    torch.testing.assert_close(res.cpu().double(), _oracle(case), rtol=1e-4, atol=1e-5)


def test_strided_q_and_out():
    """q and out as views into fused buffers (e.g. the q part of a qkv projection)."""
    case = _make_case([9, 40], [1, 3], num_heads=4, num_kv_heads=1, head_dim=32, block_size=16,
                      dtype=torch.float32, seed=9)
    rows = case["q"].shape[0]
    qkv = torch.randn(rows, 4 + 2, 32, device=DEVICE)
    qkv[:, :4] = case["q"]
    q = qkv[:, :4]
    out_buf = torch.full((rows, 6, 32), 7.0, device=DEVICE)
    out = out_buf[:, 1:5]
    paged_decode_attention(q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                           case["query_start_loc"], case["scale"], 3, num_splits=2, out=out)
    assert (out_buf[:, 0] == 7.0).all() and (out_buf[:, 5] == 7.0).all()
    torch.testing.assert_close(out.cpu().double(), _oracle(case), rtol=1e-4, atol=1e-5)


def test_page_size_one():
    """Token-granular pages (block_size 1, which Triton specialises as a constant)."""
    case = _make_case([33, 3], [2, 3], num_heads=4, num_kv_heads=2, head_dim=32, block_size=1,
                      dtype=torch.float32, seed=21)
    _run_and_check(case, 3, 3, FP32_TOL)


def test_head_dim_128():
    case = _make_case([40], [2], num_heads=2, num_kv_heads=1, head_dim=128, block_size=16,
                      dtype=torch.float32, seed=13)
    _run_and_check(case, 2, 2, FP32_TOL)


def test_choose_num_splits_uses_capacities_only():
    # Batch 1, 8 KV heads on ~132 SMs: split to fill the GPU, capped at MAX_SPLITS.
    assert choose_num_splits(1, 8, 512, 16) == MAX_SPLITS
    # Large batches need no split.
    assert choose_num_splits(64, 8, 512, 16) == 1
    # Never more splits than KV tiles of a full-capacity sequence.
    assert choose_num_splits(1, 1, 1, 16) == 1
    assert choose_num_splits(1, 1, 4, 16) == -(-64 // TILE_N)
    assert choose_num_splits(8, 8, 512, 16) == 3  # ceil(132 / 64)
    # Independent of how full the sequences are: only shapes go in.
    assert choose_num_splits(2, 8, 512, 16) == choose_num_splits(2, 8, 512, 16, torch.device("cpu"))


def test_rejects_bad_shapes():
    case = _make_case([4], [1], num_heads=3, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                               case["query_start_loc"], case["scale"], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 and realistic sizes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_larger_batches(dtype, head_dim):
    seq_lens = [1, 17, 300, 1000, 2049, 513]
    q_lens = [1, 4, 2, 3, 4, 1]
    case = _make_case(seq_lens, q_lens, num_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=16,
                      dtype=dtype, layout="engine", capacity_blocks=160, seed=1)
    ref = _oracle(case)
    for splits in (1, 5, None):
        out = torch.full_like(case["q"], float("nan"))
        paged_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
                               case["query_start_loc"], case["scale"], 4, num_splits=splits, out=out)
        got = out.double().cpu()
        assert not torch.isnan(got).any()
        err = (got - ref).abs().max().item()
        assert err <= (1e-2 if dtype == torch.bfloat16 else 2e-3) * ref.abs().max().item(), (splits, err)
