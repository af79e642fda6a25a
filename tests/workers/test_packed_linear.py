"""oneDNN-packed linear layers (float32, and bfloat16 where the CPU runs it): the same matmul as
the plain weight, in eager code and in a compiled graph, the plain weights freed, and a model that
fingerprints and loads as the unpacked one does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.cpu_features import last_level_cache_bytes
from pdserve.workers.model import packed_linear
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model.loader import load_model
from pdserve.workers.model.packed_linear import PackedLinear, linear, num_parameters, pack_linears
from pdserve.workers.tiny.builder import Arch
from pdserve.workers.transfer.fingerprint import module_fingerprint

BF16 = torch.bfloat16
_NO_BF16 = pytest.mark.skipif(not packed_linear.supported(BF16, torch.device("cpu")),
                              reason="oneDNN does not run bfloat16 on this CPU")
DTYPES = [torch.float32, pytest.param(BF16, marks=_NO_BF16)]
# Against float64: bfloat16 output is one rounding of a float32 accumulation (like F.linear's);
# float32 differs from float64 by the accumulation's order only.
TOL = {torch.float32: 1e-5, BF16: 1.6e-2}

pytestmark = pytest.mark.skipif(not packed_linear.supported(torch.float32, torch.device("cpu")),
                                reason="no oneDNN in this torch build")


def _layer(inp: int, out: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias).to(dtype)
    layer.requires_grad_(False)
    return layer


def _float64(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.double()
    return torch.nn.functional.linear(x.double(), layer.weight.double(), bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_the_plain_matmul(rows: int, bias: bool, dtype: torch.dtype) -> None:
    plain = _layer(96, 200, bias, dtype=dtype)
    packed = PackedLinear(plain)
    assert torch.equal(packed.dense_weight(), plain.weight)  # a layout, not other numbers
    x = torch.randn(rows, 96).to(dtype)
    out = linear(x, packed)
    assert out.shape == (rows, 200) and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), _float64(x, plain), rtol=tol, atol=tol)
    torch.testing.assert_close(out, linear(x, plain), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_strided_input_is_taken_as_its_values(dtype: torch.dtype) -> None:
    plain = _layer(64, 32, False, dtype=dtype)
    packed = PackedLinear(plain)
    wide = torch.randn(5, 128).to(dtype)
    x = wide[:, ::2]  # not contiguous
    tol = TOL[dtype]
    torch.testing.assert_close(linear(x, packed).double(), _float64(x, plain), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_op_matches_eager_at_any_row_count(dtype: torch.dtype) -> None:
    plain = _layer(64, 48, True, dtype=dtype)
    packed = PackedLinear(plain)

    def f(x: torch.Tensor) -> torch.Tensor:
        return linear(torch.nn.functional.silu(x), packed) * 2

    compiled = torch.compile(f, dynamic=True)
    tol = TOL[dtype]
    with torch.inference_mode():
        for rows in (1, 3, 17):
            x = torch.randn(rows, 64).to(dtype)
            torch.testing.assert_close(compiled(x), f(x), rtol=tol, atol=tol)


def test_packing_a_model_frees_its_plain_weights_and_keeps_its_parameter_count() -> None:
    model = nn.Sequential(_layer(32, 64, True), nn.ReLU(), _layer(64, 16, False, seed=1))
    before = sum(p.numel() for p in model.parameters())
    assert pack_linears(model, float32_min_bytes=0) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) == 64  # the bias alone is left a parameter
    assert num_parameters(model) == before


def test_small_float32_weights_stay_plain_and_bfloat16_is_packed_at_any_size() -> None:
    """Below 1 MiB a float32 weight is faster unpacked (oneDNN's per-call cost); bfloat16 layers are
    packed at any size (packed beat bfloat16's plain layout where measured)."""
    small, large = _layer(256, 1023, False), _layer(256, 1024, False)  # 1 MiB - 1 KiB, 1 MiB of float32
    assert not packed_linear.worth_packing(small) and packed_linear.worth_packing(large)
    assert packed_linear.worth_packing(_layer(16, 16, False, dtype=BF16))
    model = nn.Sequential(small, large)
    assert pack_linears(model) == 1
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)


def test_a_float32_model_held_in_cache_is_not_packed(make_model: Callable[..., Path]) -> None:
    """float32 linears that all fit in the last-level cache stay unpacked, on pdserve's op
    (packed_linear.float32_floor); larger than the cache, those from 1 MiB are packed; the op
    turned off, the floor is 1 MiB whatever the cache."""
    model_dir = make_model(tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2))
    cfg, cpu = ModelConfig.from_pretrained(str(model_dir)), torch.device("cpu")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, AttentionBackend.TORCH, 64)
    weights = [m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear)]
    assert max(weights) >= packed_linear.FLOAT32_MIN_BYTES  # the head: would be packed by size
    held = packed_linear.float32_floor(model, cache_bytes=sum(weights))
    if cpu_linear.load() is not None:
        assert held > max(weights)
    else:
        assert held == packed_linear.FLOAT32_MIN_BYTES
    assert packed_linear.float32_floor(model, cache_bytes=sum(weights) - 1) == packed_linear.FLOAT32_MIN_BYTES
    loaded = load_model(model_dir, cfg, torch.float32, cpu, AttentionBackend.TORCH, 64)  # this CPU's cache
    held_here = cpu_linear.load() is not None and sum(weights) <= last_level_cache_bytes()
    assert isinstance(loaded.lm_head, PackedLinear) != held_here


def test_a_packed_weight_is_released_with_its_layer() -> None:
    packed = PackedLinear(_layer(16, 16, False))
    handle = packed.handle
    assert handle in packed_linear._weights
    del packed
    assert handle not in packed_linear._weights


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_model_is_packed_and_matches_the_plain_one(
        make_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Loaded on CPU, every linear worth it is packed (the tied lm_head too, on its own copy;
    float32 layers under 1 MiB stay plain), the logits match the plain-layout model's within the
    dtype's noise, and the fingerprint, what a KV link compares, is the same: a packed worker
    takes a plain worker's KV."""
    # Qwen2: a tied head, and biases on q/k/v
    model_dir = make_model(tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2))
    cfg, cpu = ModelConfig.from_pretrained(str(model_dir)), torch.device("cpu")
    monkeypatch.setattr(packed_linear, "last_level_cache_bytes", lambda: 0)  # a model larger than the cache
    packed = load_model(model_dir, cfg, dtype, cpu, AttentionBackend.TORCH, 64)
    monkeypatch.setenv(packed_linear.ENV, "0")
    plain = load_model(model_dir, cfg, dtype, cpu, AttentionBackend.TORCH, 64)
    down = packed.model.layers[0].mlp.down_proj
    assert isinstance(packed.lm_head, PackedLinear)  # vocab x 128 float32: over 1 MiB
    assert isinstance(down, PackedLinear if dtype is BF16 else nn.Linear)
    assert isinstance(plain.lm_head, nn.Linear) and cfg.tie_word_embeddings and cfg.attention_bias
    assert torch.equal(packed.lm_head.dense_weight(), packed.model.embed_tokens.weight)  # tied, kept apart
    assert module_fingerprint(str(model_dir), packed) == module_fingerprint(str(model_dir), plain)
    hidden = torch.randn(6, 128).to(dtype)
    with torch.inference_mode():
        a, b = packed.compute_logits(hidden), plain.compute_logits(hidden)
    rel = float((a - b).norm() / b.norm())
    assert rel < (1e-2 if dtype is BF16 else 1e-5), rel


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    """The largest level's size (K/M suffixes), whatever the order of the index directories; 0
    where sysfs has no cache directory."""
    for index, level, size in (("index0", "1", "32K"), ("index2", "2", "512K"), ("index3", "3", "32768K"),
                               ("index10", "1", "64K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes.__wrapped__(str(tmp_path)) == 32 << 20
    assert last_level_cache_bytes.__wrapped__(str(tmp_path / "absent")) == 0
