"""The CPU decode linear op (pdserve/kernels/cpu_linear.py) against float64: every row count from none to
past the op's limit (where MKL takes over inside it), widths that end mid-panel and mid-vector,
odd input widths, with and without bias, in eager code and in a compiled graph whose row count
varies; and which of a loaded model's layers take it. Skips where the op cannot be built."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.model import packed_linear
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.loader import load_model
from pdserve.workers.tiny.builder import Arch

pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="the CPU linear op could not be built here")

# float32 against float64: the order of one K-long sum's roundings; K <= 704 here
TOL = 2e-5


def _case(rows: int, k: int, n: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    weight_t = (torch.randn(k, n, generator=gen) / k**0.5).contiguous()
    b = torch.randn(n, generator=gen) if bias else None
    return x, weight_t, b


def _float64(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight_t.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 16, 17, 64])
@pytest.mark.parametrize("shape", [(256, 384), (704, 256), (37, 101), (5, 50), (64, 8), (96, 49)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_computes_the_matmul(rows: int, shape: tuple[int, int], bias: bool) -> None:
    k, n = shape  # 101 = two panels of 48 and 5 columns; 49 = one panel and one column
    x, weight_t, b = _case(rows, k, n, bias, seed=rows * 1000 + k + n)
    out = cpu_linear.linear(x, weight_t, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _float64(x, weight_t, b), rtol=TOL, atol=TOL)
    torch.testing.assert_close(torch.ops.pdserve.cpu_linear(x, weight_t, b), out, rtol=0, atol=0)


def test_leading_dims_are_kept_and_a_strided_input_is_read_right() -> None:
    x, weight_t, b = _case(12, 96, 144, True, seed=1)
    x3 = x.view(3, 4, 96)
    torch.testing.assert_close(cpu_linear.linear(x3, weight_t, b).double(), _float64(x, weight_t, b).view(3, 4, 144),
                               rtol=TOL, atol=TOL)
    wide = torch.randn(5, 200)[:, 10:106]  # rows 200 floats apart
    torch.testing.assert_close(cpu_linear.linear(wide, weight_t, None).double(), _float64(wide, weight_t, None),
                               rtol=TOL, atol=TOL)


def test_bad_operands_raise() -> None:
    x, weight_t, _ = _case(2, 32, 40, False, seed=2)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.linear(x.double(), weight_t.double(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_linear.linear(x, torch.randn(40, 32).t(), None)
    with pytest.raises(RuntimeError, match="K"):
        cpu_linear.linear(torch.randn(2, 33), weight_t, None)


def test_a_compiled_graph_calls_it_for_every_row_count() -> None:
    _, weight_t, b = _case(1, 64, 112, True, seed=3)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.pdserve.cpu_linear(x, weight_t, b)) * 2

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for rows in (1, 5, 16, 40):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-6, atol=1e-6)


def test_a_loaded_float32_model_runs_its_unpacked_linears_on_the_op(make_model: Callable[..., Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers loader.py leaves unpacked (float32 under the packing floor: all of this model's)
    are marked for the op and give what F.linear gives, biases included (Qwen2's q/k/v); with
    PDSERVE_CPU_LINEAR_KERNEL=0 none is."""
    model_dir = make_model(tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2))
    cfg, cpu = ModelConfig.from_pretrained(str(model_dir)), torch.device("cpu")

    def marked(model: nn.Module) -> list[nn.Linear]:
        return [m for m in model.modules()
                if isinstance(m, nn.Linear) and getattr(m, packed_linear.CPU_LINEAR_OP, False)]

    model = load_model(model_dir, cfg, torch.float32, cpu, AttentionBackend.TORCH, 64)
    layers = marked(model)
    plain = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert layers and layers == plain  # every unpacked float32 linear
    assert any(layer.bias is not None for layer in layers)
    for layer in layers:
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(packed_linear.linear(x, layer), torch.nn.functional.linear(x, layer.weight,
                                   layer.bias), rtol=TOL, atol=TOL)
    monkeypatch.setenv(cpu_linear.ENV, "0")
    x = torch.randn(2, layers[0].in_features)  # a layer that chose the op at load keeps it
    torch.testing.assert_close(packed_linear.linear(x, layers[0]), torch.nn.functional.linear(
        x, layers[0].weight, layers[0].bias), rtol=TOL, atol=TOL)
    off = load_model(model_dir, cfg, torch.float32, cpu, AttentionBackend.TORCH, 64)
    assert not marked(off)


def test_only_float32_in_the_transposed_layout_is_usable() -> None:
    w = torch.randn(40, 32)
    assert cpu_linear.usable(w.t().contiguous().t())
    assert not cpu_linear.usable(w)  # the plain [out, in] layout: MKL's transposed operand, not ours
    assert not cpu_linear.usable(w.t().contiguous().t().to(torch.bfloat16))
