"""Attention and fused ops over the paged KV cache: PyTorch references here,
Triton kernels beside them, picked by `pdserve.kernels.attention`."""
