"""Plain factory functions for tests (fixtures live in conftest.py)."""

from __future__ import annotations

from pdserve.workers.tiny.builder import Arch, TinyModelSpec


def tiny_spec(arch: Arch | str = Arch.LLAMA, **kw: object) -> TinyModelSpec:
    """A small model spec: 2 layers, hidden 64, 4 heads, 2 KV heads unless overridden."""
    fields: dict[str, object] = dict(arch=arch, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    fields.update(kw)
    return TinyModelSpec(**fields)  # type: ignore[arg-type]
