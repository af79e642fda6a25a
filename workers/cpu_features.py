"""What this CPU has that the engine's choices depend on: native bfloat16 (`dtype="auto"`), and
the size of its last-level cache (whether float32 linears are packed: workers/model/packed_linear.py).

Native bfloat16:
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


@functools.cache
def last_level_cache_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of the first CPU's largest cache level (its L3 on most x86 parts; shared by the
    cores, and on a VM shared with its neighbours too), from sysfs; 0 where it cannot be read."""
    best_level, best_size = 0, 0
    for index in sorted(Path(cache_dir).glob("index[0-9]*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if scale != 1 else size
        if not digits.isdigit():
            continue
        if level > best_level:
            best_level, best_size = level, int(digits) * scale
    return best_size
