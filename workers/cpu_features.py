"""Whether this CPU computes bfloat16 natively, which decides `dtype="auto"` on CPU.

With AMX-BF16 or AVX512-BF16, oneDNN runs bfloat16 matmuls several times faster than
float32 (a 2048 x 576 x 1536 linear on 2 Xeon cores with AMX: 1.3 ms against 8.9 ms;
docs/engine.md), and the weights and KV cache take half the memory: vLLM's CPU build
downcasts to bfloat16 there too. Without them bfloat16 is emulated and slower than
float32, so float32 stays the choice. Linux reports the flags in /proc/cpuinfo; where
it cannot be read, the answer is no (float32 is always correct).
"""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's `flags` line of a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return False
    return bool(cpu_flags(text) & BF16_FLAGS)
