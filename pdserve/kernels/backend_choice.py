"""Which attention kernel the model calls: a setting, so it imports no torch (the CLI's parser and
`pdserve serve`'s driver read it before they need torch, if they ever do)."""

from __future__ import annotations

import enum
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class AttentionBackend(str, enum.Enum):
    TORCH = "torch"
    TRITON = "triton"
    AUTO = "auto"

    def resolve(self, device: torch.device) -> AttentionBackend:
        """The concrete backend for `device`. auto: Triton on CUDA, the PyTorch reference on CPU
        (where Triton only runs in its interpreter: correct, and very slow)."""
        if self is AttentionBackend.AUTO:
            if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
                return AttentionBackend.TRITON
            return AttentionBackend.TORCH
        if self is AttentionBackend.TRITON and importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend: 'triton' needs the triton package")
        return self
