"""The CPU a benchmark ran on, as its header names it.

/proc/cpuinfo's model name is just "AMD EPYC" on the shared VMs this project measures on, which
does not tell Zen 3, 4 and 5 apart (docs/performance.md, the machines): the CPU family and the
bfloat16 instructions (what `--dtype auto` decides by) go with it.
"""

from __future__ import annotations

import platform

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_name() -> str:
    """`AMD EPYC (CPU family 25; avx512_bf16)`; platform's word for it off Linux."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" not in info:
        return platform.processor() or platform.machine()
    bf16 = [flag for flag in BF16_FLAGS if flag in info.get("flags", "").split()]
    return (f"{info['model name']} (CPU family {info.get('cpu family', '?')}; "
            f"{', '.join(bf16) or 'no bfloat16 instructions'})")
