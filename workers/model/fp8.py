"""fp8 (e4m3) linear layers: weights stored in one byte, a float32 scale per output channel.

A decode step streams every weight once; in fp8 that is half the bytes of bf16, so on Hopper a
batch-1 step can be up to twice as fast. Two ways in, as vLLM offers them:

* an fp8 checkpoint (`quantization_config` with `quant_method` "fp8", vLLM's own format, or
  "compressed-tensors" with 8-bit float weights, llm-compressor's): its e4m3 weights load as
  they are, with their scales (per tensor, per channel, or per [bn, bk] block);
* `quantization="fp8"` (`--quantization fp8`) on a 16/32-bit checkpoint: each linear weight
  is quantized at load, per output channel (amax / 448).

Every scale becomes one float32 per output row: a per-tensor scale is repeated over its rows
(which also lets q/k/v and gate/up, fused here, keep their own scales); a block-scaled
weight (Qwen3/DeepSeek FP8) is dequantized and quantized again per row at load (the same
e4m3 grid, a coarser scale: a little more rounding). Embeddings, norms and the LM head stay
in the model's dtype, as in vLLM's fp8 checkpoints.

Activations are quantized on the fly, per token (row amax / 448), and the product is
`(x_q * x_scale) @ (w_q * w_scale).T`. On a CUDA device that computes in fp8 (sm_89 and up) it
is `torch._scaled_mm` with row-wise scales; elsewhere (a CPU, an older GPU) the same product is
emulated in float32 from the same quantized values, so the CPU tests hold the format and the
arithmetic to a float64 reference. A checkpoint's static activation scales (`input_scale`) are
not used: dynamic per-token scales fit each token's range at least as closely.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros with this scale, not NaN


SOURCE_SAMPLE = 16  # elements of a quantized layer's source weight kept for the model fingerprint


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with W in e4m3 ([out, in]) times `weight_scale` ([out], float32)."""

    # Parameters whose dtype is their own, not the model's (the loader allocates them so).
    own_dtypes = {"weight": E4M3, "weight_scale": torch.float32}

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Fp8Linear:
        """`layer`'s weight quantized per output channel (its bias kept as it is)."""
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features = layer.in_features, layer.out_features
        weight, scale = quantize(layer.weight.detach())
        # What a model fingerprint samples of it (workers/transfer/fingerprint.py): the weight it was
        # made from. Its e4m3 bytes and scales depend on the rows' extent, which a tensor-parallel
        # rank's row-parallel shard (o_proj, down_proj: half the columns) does not share with the
        # whole model's, so fingerprinted as they are, pools of other sizes refused each other's KV.
        q.source_sample = layer.weight.detach().reshape(-1)[:SOURCE_SAMPLE].clone()
        q.weight = nn.Parameter(weight, requires_grad=False)
        q.weight_scale = nn.Parameter(scale, requires_grad=False)
        q.bias = layer.bias
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantized_sources(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(layer name, the first elements of the weight it was quantized from) of every layer
    `quantize_linears` made (not an fp8 checkpoint's: those are loaded as they are)."""
    for name, module in model.named_modules():
        sample = getattr(module, "source_sample", None)
        if isinstance(module, Fp8Linear) and sample is not None:
            yield name, sample


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 [out, in], float32 scales [out]): each row scaled so its largest
    magnitude maps to 448, the format's largest finite value."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / E4M3_MAX).clamp(min=_MIN_SCALE)
    return (w32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from e4m3 weights and per-row scales."""
    return w.float() * scale.float()[:, None]


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's per-tensor ([] or [1]) or per-channel ([rows] or [rows, 1]) weight scale
    as one float32 per row."""
    flat = scale.float().flatten()
    if flat.numel() == 1:
        return flat.expand(rows).clone()
    if flat.numel() != rows:
        raise ValueError(f"weight_scale: {tuple(scale.shape)} is neither per tensor nor per channel of {rows} rows")
    return flat.clone()


def requantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """A block-scaled e4m3 weight ([out, in], a scale per [bn, bk] block, `weight_scale_inv`:
    the dequantized weight is w * scale) as e4m3 with per-row scales (`quantize`)."""
    bn, bk = block
    out, inp = w.shape
    if scale_inv.shape != (-(-out // bn), -(-inp // bk)):
        raise ValueError(f"weight_scale_inv: {tuple(scale_inv.shape)} does not tile a {out}x{inp} weight "
                         f"in {bn}x{bk} blocks")
    full = scale_inv.float().repeat_interleave(bn, 0)[:out].repeat_interleave(bk, 1)[:, :inp]
    return quantize(w.float() * full)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, in] -> (e4m3 [T, in], float32 scales [T, 1]), per token."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_linear(x: torch.Tensor, layer: Fp8Linear) -> torch.Tensor:
    """The layer's product in x's dtype (module docstring: which kernel computes it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_activations(x2)
    if _scaled_mm_ok(x2):
        out = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale[None, :],
                               out_dtype=x.dtype)
    else:
        out = ((xq.float() * x_scale) @ dequantize(layer.weight, layer.weight_scale).t()).to(x.dtype)
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*shape[:-1], layer.out_features)


def _scaled_mm_ok(x: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` computes this product: a CUDA device with fp8 tensor cores
    (compute capability 8.9+) and a 16-bit output (row-wise scales need bf16 there)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 9))


def quantize_linears(model: nn.Module) -> int:
    """Replace the decoder's linear layers (q/k/v, o, gate/up, down) by Fp8Linear, quantized
    from their weights; returns how many. The LM head stays as it is."""
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and name in DECODER_LINEARS]
    for parent, name in targets:
        setattr(parent, name, Fp8Linear.from_linear(getattr(parent, name)))
    return len(targets)


# The decoder's linear layers by module name (workers/model/llama.py, layers.py).
DECODER_LINEARS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
