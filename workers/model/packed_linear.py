"""Linear layers with oneDNN-prepacked weights, for float32 and bfloat16 on CPU.

Why: a decode step's matmuls have a handful of rows (the batch) against weights
that do not fit in cache; they are bound by how fast the GEMM streams the
weights. PyTorch's `F.linear` on a plain bfloat16 [out, in] matrix streams them
at 5-7 GB/s on one core of an Intel test machine; reordered once into oneDNN's
blocked layout the same GEMMs stream at 7-11 GB/s (SmolLM2-135M's linears at
batch 8: 0.67x the plain layout's time on one core; docs/engine.md, "Prepacked
weights and the decode attention op"). In float32 on an AMD EPYC (Zen 3), MKL's
GEMM on the column-major layout streamed 1-2.5 GB/s at 4-64 rows, oneDNN's packed
one 1.6-3.7x faster (level at 2 rows); a SmolLM2 decode step at batch 8 took 0.67x
the time on one thread, 0.47x on two. The price: a single row, where MKL's
column-major GEMV streams ~11 GB/s and oneDNN ~6 (SmolLM2's batch-1 step 1.5x slower
on one thread, level on two). It is what Inductor's freezing pass and vLLM's CPU
backend do.

Small float32 weights stay unpacked: PyTorch's call into oneDNN costs ~40 us however
small the matmul (a 64 x 64 layer: 46 us packed, 8.5 plain, on the AMD EPYC), which the
faster streaming repays only past ~1 MiB of weight (below it the plain layout won at
nearly every row count from 1 to 16, on one and two threads, up to 4.6x at one row; at
2 MiB and more packed won from 2 rows on; docs/engine.md); they run decode steps on pdserve's
own op (pdserve/kernels/cpu_linear.py), and a model whose float32 linears all fit in the last-level cache
is not packed at all (`float32_floor`). bfloat16 is packed whatever
its size: packed beat its plain layout on the Intel machine, and small bfloat16 weights
were not measured apart.

How: each packed layer's weight lives in a process-wide table under an integer
handle. The compiled model calls the `pdserve::packed_linear` op with the
handle, so the compiler sees an opaque op on a dense input (Inductor cannot
take oneDNN's opaque tensors as graph inputs); eager code calls oneDNN
directly. The plain weight is dropped once packed: no second copy of the model.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_linear
from pdserve.workers.cpu_features import last_level_cache_bytes
from pdserve.workers.model import torch_ops
from pdserve.workers.model.fp8 import Fp8Linear, fp8_linear

ENV = "PDSERVE_CPU_PACKED_LINEAR"  # "0" keeps the plain layout (an A/B switch)
FLOAT32_MIN_BYTES = 1 << 20  # a smaller float32 weight is faster unpacked (the module docstring)
CPU_LINEAR_OP = "pdserve_cpu_linear_op"  # an nn.Linear attribute: True where use_cpu_linear_op chose the op

_weights: dict[int, torch.Tensor] = {}  # handle -> packed weight
_handles = itertools.count()
_lock = threading.Lock()


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` are packed: float32, and bfloat16 on a CPU that
    oneDNN runs it on."""
    if device.type != "cpu" or os.environ.get(ENV, "1") == "0":
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype is torch.float32


class PackedLinear(nn.Module):
    """An nn.Linear whose weight is oneDNN-packed: call it through `linear(x, layer)`.

    The packed weight is not a parameter (oneDNN's opaque tensors cannot be viewed,
    moved or hashed like one); `dense_weight()` gives the plain matrix back."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bias = layer.bias
        # No batch-size hint: the packing then suits every row count a step has (1 to thousands).
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach().contiguous(), None)
        with _lock:
            self.handle = next(_handles)
            _weights[self.handle] = packed
        weakref.finalize(self, _weights.pop, self.handle, None)

    @property
    def packed(self) -> torch.Tensor:
        return _weights[self.handle]

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight in the plain layout (a new tensor)."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def _packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias with W the packed weight under `handle`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), _weights[handle], bias, "none", [], "")
    return out


def _packed_linear_fake(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


torch_ops.define("packed_linear(Tensor x, int handle, int out_features, Tensor? bias) -> Tensor",
                 _packed_linear, _packed_linear_fake, "CPU")


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`layer(x)` for an nn.Linear, a PackedLinear or an Fp8Linear, without nn.Module's per-call cost."""
    if isinstance(layer, Fp8Linear):
        return fp8_linear(x, layer)
    if isinstance(layer, PackedLinear):
        if torch.compiler.is_compiling():
            compiled: torch.Tensor = torch.ops.pdserve.packed_linear(x, layer.handle, layer.out_features, layer.bias)
            return compiled
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed, layer.bias, "none", [],
                                                               "")
        return out
    assert isinstance(layer, nn.Linear)
    if getattr(layer, CPU_LINEAR_OP, False):  # few rows take our op, more MKL (use_cpu_linear_op)
        if torch.compiler.is_compiling():
            own: torch.Tensor = torch.ops.pdserve.cpu_linear(x, layer.weight.t(), layer.bias)
            return own
        return cpu_linear.linear(x, layer.weight.t(), layer.bias)
    return F.linear(x, layer.weight, layer.bias)


def use_cpu_linear_op(layer: nn.Linear) -> bool:
    """Mark `layer` to run through pdserve/kernels/cpu_linear.py's op if it can (a float32 weight on
    CPU stored as the transpose of a contiguous [in, out] matrix, the op built and not turned
    off): decided once, at load, so a compiled graph and eager calls agree. Returns whether."""
    use = cpu_linear.usable(layer.weight)
    setattr(layer, CPU_LINEAR_OP, use)
    return use


def float32_floor(model: nn.Module, cache_bytes: int | None = None) -> int:
    """The weight size from which `model`'s float32 linears are packed: FLOAT32_MIN_BYTES, or none
    of them (a size above all) when pdserve's own op runs the unpacked ones (pdserve/kernels/cpu_linear.py)
    and all of them together fit in the last-level cache (`cache_bytes`; this CPU's by default).

    Why: held in cache, the weights stream faster through the op than through oneDNN's packed GEMM
    at every decode row count (the tiny model's linears at 1-16 rows, AMD EPYC: 0.60-0.83x of
    oneDNN's time on two threads, 0.60-0.98x on one), and a prefill's rows go to MKL on the same
    layout (1.16-1.24x oneDNN's time there: the price). Streamed from memory,
    oneDNN's contiguous blocks win from ~8 rows (SmolLM2-135M: 1.1-1.35x at 8-16 rows), so a
    model larger than the cache keeps its packing. docs/engine.md has the figures."""
    if cache_bytes is None:
        cache_bytes = last_level_cache_bytes()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype is torch.float32]
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if linears and total <= cache_bytes and cpu_linear.load() is not None:
        return 1 + max(m.weight.numel() * m.weight.element_size() for m in linears)
    return FLOAT32_MIN_BYTES


def worth_packing(layer: nn.Linear, float32_min_bytes: int | None = None) -> bool:
    """Whether `layer` runs faster packed: bfloat16 always, float32 from `float32_min_bytes`
    of weight (FLOAT32_MIN_BYTES when None)."""
    weight, floor = layer.weight, FLOAT32_MIN_BYTES if float32_min_bytes is None else float32_min_bytes
    return weight.dtype is not torch.float32 or weight.numel() * weight.element_size() >= floor


def pack_linears(model: nn.Module, float32_min_bytes: int | None = None) -> int:
    """Replace every nn.Linear in `model` worth packing by a PackedLinear (their plain weights
    are freed); returns how many. A weight shared by two modules must be untied first."""
    # (parent, name) only: holding the layers themselves would keep every plain weight alive
    # until the end, twice the model's memory at the peak instead of one layer more.
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and worth_packing(child, float32_min_bytes)]
    for parent, name in targets:
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(targets)


def packed_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, plain weight) of every packed layer, named as the nn.Linear's weight was."""
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            yield f"{name}.weight", module.dense_weight()


def num_parameters(model: nn.Module) -> int:
    """Parameters of `model`, packed weights included."""
    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
    return packed + sum(p.numel() for p in model.parameters())


__all__ = ["CPU_LINEAR_OP", "PackedLinear", "float32_floor", "linear", "num_parameters", "pack_linears",
           "packed_weights", "supported", "use_cpu_linear_op", "worth_packing"]
