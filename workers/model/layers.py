"""Building blocks of the Llama-family decoder: norm, rotary embedding, MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.workers.model.config import RopeConfig, rope_inv_freq
from pdserve.workers.model.packed_linear import linear


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (returns the new residual too).

    Computed in float32 and cast back before the weight multiply, the way
    transformers does, so half-precision outputs match it.
    """

    def __init__(self, hidden_size: int, eps: float, use_triton: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            from pdserve.kernels.triton_norm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps), x
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight, x


class RotaryEmbedding(nn.Module):
    """Neox-style (half-split) RoPE from a precomputed cos/sin table.

    `out = x * cos + roll(x, D/2) * sin_signed` with sin_signed = [-sin, sin] is
    bit-identical to transformers' `x * cos + rotate_half(x) * sin` and costs
    three ops instead of six.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, use_triton: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        self.use_triton = use_triton
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2], float32 like transformers
        cos, sin = freqs.cos(), freqs.sin()
        if self.use_triton:  # the kernel reads half tables and gathers rows itself
            self.cos, self.sin = cos.to(dtype), sin.to(dtype)
            return
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step input of `apply`: cos/sin rows [T, D], or (Triton) the positions themselves.
        No size-1 dimension: a compiled tensor-parallel forward breaks its graph at each all-reduce,
        and a resumed graph takes these as inputs, every dimension dynamic (compiled.py: no 0/1
        specialisation), where a dimension of 1 could not broadcast."""
        if self.use_triton:
            return positions, positions
        return self.cos[positions], self.sin[positions]

    def apply(  # type: ignore[override]  # not nn.Module.apply(fn): this module is never walked with it
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        if self.use_triton:
            from pdserve.kernels.triton_rope import apply_rope

            return apply_rope(x, cos_sin[0], self.cos, self.sin)
        cos, sin = cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)  # x: [T, heads, D]; these broadcast over heads
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, use_triton: bool = False, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.use_triton = use_triton  # silu x mul in one launch (pdserve/kernels/triton_act.py), not two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if self.use_triton:
            from pdserve.kernels.triton_act import silu_and_mul

            return linear(silu_and_mul(gate_up.view(-1, 2 * self.intermediate_size)).view(*x.shape[:-1], -1),
                          self.down_proj)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # type: ignore[no-untyped-call]
        return linear(F.silu(gate).mul_(up), self.down_proj)
