"""Fused Triton ops (add + RMSNorm, RoPE, RoPE + KV write, SiLU x mul) against their PyTorch references and the
model's own layers. Without a GPU these run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1): tiny shapes, float32 and float16 only (no bf16 there)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import triton_norm
from pdserve.kernels.reference import rms_norm_ref, rope_ref
from pdserve.kernels.triton_act import silu_and_mul
from pdserve.kernels.triton_cache import write_kv
from pdserve.kernels.triton_norm import fused_add_rms_norm
from pdserve.kernels.triton_rope import apply_rope, rope_cos_sin
from pdserve.kernels.triton_rope_cache import rope_and_write_kv
from pdserve.workers.model.config import RopeConfig, rope_inv_freq
from pdserve.workers.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LLAMA3 = RopeConfig(
    rope_type="llama3", factor=8, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=256
)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# Against the layers: float32 arithmetic in another order (rope: 1e-4 budget).
LAYER_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("H", [32, 48, 100])
def test_norm_matches_reference(dtype: torch.dtype, with_residual: bool, H: int) -> None:
    T = 5
    x = _randn(T, H, dtype=dtype, seed=H)
    res = _randn(T, H, dtype=dtype, seed=H + 1) if with_residual else None
    w = (1 + 0.5 * _randn(H, dtype=torch.float32, seed=H + 2)).to(dtype)
    x0, res0 = x.clone(), None if res is None else res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_ref(x, res, w, 1e-6)
    assert out.dtype == dtype and new_res.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)  # one rounded add, same as torch
    # Out of place: inputs untouched.
    assert torch.equal(x, x0) and (res is None or torch.equal(res, res0))
    if res is None:
        assert new_res is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_matches_layer(dtype: torch.dtype, with_residual: bool) -> None:
    T, H, eps = 6, 64, 1e-5
    layer = RMSNorm(H, eps)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.3 * torch.randn(H, generator=_gen(7)))
    layer = layer.to(device=DEVICE, dtype=dtype)
    x = _randn(T, H, dtype=dtype, seed=8) * 3
    res = _randn(T, H, dtype=dtype, seed=9) if with_residual else None
    with torch.no_grad():
        ref_out, ref_res = layer(x, res)
    out, new_res = fused_add_rms_norm(x, res, layer.weight.detach(), eps)
    torch.testing.assert_close(out, ref_out, **LAYER_TOL[dtype])
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_non_contiguous_inputs(dtype: torch.dtype) -> None:
    T, H = 4, 40
    wide = _randn(T, 3 * H, dtype=dtype, seed=11)
    x = wide[:, H : 2 * H]  # row stride 3H: a slice of a fused output
    res = _randn(H, T, dtype=dtype, seed=12).t()  # column stride != 1: copied internally
    w = _randn(2 * H, dtype=dtype, seed=13)[::2]  # strided weight
    assert not x.is_contiguous() and not res.is_contiguous() and not w.is_contiguous()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_ref(x.contiguous(), res.contiguous(), w.contiguous(), 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    out2, same = fused_add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(out2, rms_norm_ref(x.contiguous(), None, w.contiguous(), 1e-6)[0], **TOL[dtype])
    assert same is x


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_chunked_path(monkeypatch: pytest.MonkeyPatch, with_residual: bool) -> None:
    """Rows wider than the single-block limit take the two-pass loop (forced small here)."""
    monkeypatch.setattr(triton_norm, "_MAX_SINGLE_BLOCK", 32)
    monkeypatch.setattr(triton_norm, "_CHUNK", 16)
    T, H = 3, 70  # 5 chunks, last one partial
    x = _randn(T, H, dtype=torch.float16, seed=21)
    res = _randn(T, H, dtype=torch.float16, seed=22) if with_residual else None
    w = _randn(H, dtype=torch.float16, seed=23)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float16])
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)


def test_norm_float32_vs_float64() -> None:
    T, H, eps = 7, 96, 1e-6
    x, res = (_randn(T, H, dtype=torch.float32, seed=s) for s in (31, 32))
    w = _randn(H, dtype=torch.float32, seed=33)
    out, _ = fused_add_rms_norm(x, res, w, eps)
    h = x.double() + res.double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_norm_validates_shapes() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused_add_rms_norm(x, None, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.zeros(2, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        fused_add_rms_norm(x.view(2, 2, 4), None, torch.ones(4, device=DEVICE), 1e-6)


def test_norm_empty_batch() -> None:
    x = torch.zeros(0, 16, device=DEVICE)
    out, res = fused_add_rms_norm(x, torch.zeros(0, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
    assert out.shape == (0, 16) and res.shape == (0, 16)


# ---------------------------------------------------------------- RoPE


def _tables(head_dim: int, rope: RopeConfig, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(rope_inv_freq(rope, head_dim).to(DEVICE), positions, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [16, 12])  # 12: half = 6, not a power of two
@pytest.mark.parametrize("NH", [3, 6, 8])
def test_rope_matches_reference(dtype: torch.dtype, D: int, NH: int) -> None:
    T, P = 7, 64
    cos, sin = _tables(D, RopeConfig(), P, dtype)
    x = _randn(T, NH, D, dtype=dtype, seed=D * NH)
    positions = torch.tensor([0, 5, 5, 63, 17, 1, 40], device=DEVICE)  # any order, repeats
    x0 = x.clone()
    out = apply_rope(x, positions, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, rope_ref(x, positions, cos, sin), **TOL[dtype])
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
def test_rope_matches_layer_on_qkv_slice(dtype: torch.dtype, rope: RopeConfig) -> None:
    """q and k rotated together as a strided view of the fused qkv output, like the model does."""
    H, KVH, D, T, P = 4, 2, 16, 6, 512  # positions past original_max_position_embeddings
    layer = RotaryEmbedding(D, rope, P)
    layer.build(DEVICE, dtype)
    qkv = _randn(T, (H + 2 * KVH) * D, dtype=dtype, seed=41)
    qk = qkv.view(T, H + 2 * KVH, D)[:, : H + KVH]
    assert not qk.is_contiguous()
    positions = torch.tensor([3, 100, 255, 256, 300, 511], device=DEVICE)
    cos, sin = _tables(D, rope, P, dtype)
    out = apply_rope(qk, positions, cos, sin)
    ref = layer.apply(qk, layer.lookup(positions))
    torch.testing.assert_close(out, ref, **LAYER_TOL[dtype])
    torch.testing.assert_close(out, rope_ref(qk, positions, cos, sin), **TOL[dtype])


@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
def test_rope_tables_match_layer(rope: RopeConfig) -> None:
    D, P = 32, 600
    layer = RotaryEmbedding(D, rope, P)
    layer.build(DEVICE, torch.float32)
    cos, sin = _tables(D, rope, P, torch.float32)
    assert cos.shape == sin.shape == (P, D // 2)
    assert torch.equal(layer.cos, torch.cat((cos, cos), -1))
    assert torch.equal(layer.sin, torch.cat((-sin, sin), -1))


def test_rope_strided_head_dim_and_tables() -> None:
    """Every stride is honoured: a head-dim stride of 2 and transposed tables."""
    T, NH, D, P = 5, 3, 8, 32
    x = _randn(T, NH, 2 * D, dtype=torch.float32, seed=51)[..., ::2]
    cos, sin = _tables(D, LLAMA3, P, torch.float32)
    cos_t, sin_t = cos.t().contiguous().t(), sin.t().contiguous().t()
    assert cos_t.stride(1) != 1
    positions = torch.randint(0, P, (T,), generator=_gen(52)).to(DEVICE)
    torch.testing.assert_close(apply_rope(x, positions, cos_t, sin_t), rope_ref(x, positions, cos, sin),
                               **TOL[torch.float32])


def test_rope_float32_vs_float64() -> None:
    T, NH, D, P = 6, 5, 32, 256
    inv_freq = rope_inv_freq(LLAMA3, D)
    cos, sin = rope_cos_sin(inv_freq.to(DEVICE), P, torch.float32)
    x = _randn(T, NH, D, dtype=torch.float32, seed=61)
    positions = torch.randint(0, P, (T,), generator=_gen(62)).to(DEVICE)
    out = apply_rope(x, positions, cos, sin).double()
    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]
    x64 = x.double()
    ref = torch.cat((x64[..., : D // 2] * c - x64[..., D // 2 :] * s,
                     x64[..., D // 2 :] * c + x64[..., : D // 2] * s), -1)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6


def test_rope_validates_shapes() -> None:
    cos, sin = _tables(8, RopeConfig(), 16, torch.float32)
    x = torch.zeros(2, 3, 8, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.zeros(2, 3, 7, device=DEVICE), pos, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(torch.zeros(2, 3, 16, device=DEVICE), pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, pos[:1], cos, sin)
    assert apply_rope(x[:0], pos[:0], cos, sin).shape == (0, 3, 8)


# ---------------------------------------------------------------- SiLU x mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [8, 48, 1500])
def test_silu_and_mul_matches_the_layers_two_ops(dtype: torch.dtype, inter: int) -> None:
    """Against torch's F.silu(gate).mul_(up), the layer's eager path (two roundings), and a
    float64 oracle; rows strided (a slice of a wider buffer), widths that do not fill a block."""
    wide = _randn(5, 2 * inter + 7, dtype=dtype, seed=inter) * 4
    gate_up = wide[:, : 2 * inter]  # row stride 2I + 7
    out = silu_and_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate).mul(up), **TOL[dtype])
    g64, u64 = gate.double(), up.double()
    oracle = g64 * torch.sigmoid(g64) * u64
    torch.testing.assert_close(out.double(), oracle, **LAYER_TOL[dtype])
    assert out.shape == (5, inter) and out.dtype == dtype and out.is_contiguous()
    assert silu_and_mul(gate_up[:0]).shape == (0, inter)
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(gate_up[:, :-1])


def test_gated_mlp_with_the_kernel_matches_without() -> None:
    torch.manual_seed(0)
    plain, fused = GatedMLP(32, 40).to(DEVICE), GatedMLP(32, 40, use_triton=True).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    x = _randn(3, 4, 32, dtype=torch.float32, seed=9)  # [B, T, H]: leading dims kept
    torch.testing.assert_close(fused(x), plain(x), **TOL[torch.float32])


# ---------------------------------------------------------------- RoPE + KV write


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                    (torch.float32, torch.float16)])
@pytest.mark.parametrize(("H", "KVH", "D"), [(4, 2, 16), (6, 3, 8), (2, 2, 32)])
def test_rope_and_kv_write_equal_the_two_kernels(dtype: torch.dtype, cache_dtype: torch.dtype, H: int, KVH: int,
                                                 D: int) -> None:
    """Bit for bit what apply_rope on q and k then write_kv give: the queries, every written
    slot, and nothing else in the caches (a slot of -1 writes nothing; the caches are strided
    views of a bigger buffer, the qkv rows a strided slice)."""
    T, P, blocks, bs = 9, 64, 6, 4
    cos, sin = _tables(D, LLAMA3, P, dtype)
    wide = _randn(T, (H + 2 * KVH) * D + 5, dtype=dtype, seed=H * D)
    qkv = wide[:, : (H + 2 * KVH) * D]
    positions = torch.randint(0, P, (T,), generator=_gen(H + D)).to(DEVICE)
    slots = torch.randperm(blocks * bs, generator=_gen(D))[:T].to(DEVICE)
    slots[[2, 7]] = -1

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        big = torch.full((2, blocks, bs, KVH + 1, D), float("nan"), dtype=cache_dtype, device=DEVICE)
        return big[0, :, :, :KVH], big[1, :, :, :KVH]

    want_kc, want_vc = caches()
    qk = apply_rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), positions, cos, sin)
    write_kv(qk[:, H:], qkv[:, (H + KVH) * D:].view(T, KVH, D), want_kc, want_vc, slots)
    got_kc, got_vc = caches()
    q = rope_and_write_kv(qkv, H, KVH, positions, cos, sin, got_kc, got_vc, slots)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(got_kc.nan_to_num(7.0), want_kc.nan_to_num(7.0))
    assert torch.equal(got_vc.nan_to_num(7.0), want_vc.nan_to_num(7.0))
    assert int(got_kc.isnan().all(-1).all(-1).sum()) == blocks * bs - (T - 2)  # only the 7 real slots written


def test_rope_and_kv_write_validates_shapes() -> None:
    cos, sin = _tables(8, RopeConfig(), 16, torch.float32)
    kc = torch.zeros(2, 4, 1, 8, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="qkv width"):
        rope_and_write_kv(torch.zeros(3, 30, device=DEVICE), 2, 1, pos, cos, sin, kc, kc.clone(), pos)
    with pytest.raises(ValueError, match="positions"):
        rope_and_write_kv(torch.zeros(3, 32, device=DEVICE), 2, 1, pos[:2], cos, sin, kc, kc.clone(), pos)
    assert rope_and_write_kv(torch.zeros(0, 32, device=DEVICE), 2, 1, pos[:0], cos, sin, kc, kc.clone(),
                             pos[:0]).shape == (0, 2, 8)
