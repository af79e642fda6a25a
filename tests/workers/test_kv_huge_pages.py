"""The CPU KV pool on transparent huge pages: the same zeroed tensor as torch.zeros and, where the
kernel honours madvise (THP `enabled` is madvise or always), backed by
huge pages, which the attention op's scattered block reads need (docs/performance.md)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from pdserve.workers.kv.cache import allocate_kv_caches, cpu_zeros_on_huge_pages
from pdserve.workers.model.config import ModelConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed choice of the kernel's THP setting, or None off Linux / without THP."""
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_kib_under(addr: int, length: int) -> int:
    """AnonHugePages (KiB) of the mappings of this process that overlap [addr, addr + length)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            lo, hi = int(head.group(1), 16), int(head.group(2), 16)
            inside = lo < addr + length and addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_is_a_zeroed_writable_contiguous_tensor_of_the_shape(dtype: torch.dtype) -> None:
    shape = (2, 2, 64, 16, 2, 32)  # 2 MiB in float32, 1 MiB in 16-bit types
    t = cpu_zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    gc.collect()  # the mapping lives as long as the tensor, with no other reference to it
    t[1, 1, -1] = 3  # writable to its last element: the view covers the whole shape
    assert float(t.sum()) == 3 * 16 * 2 * 32


def test_a_small_tensor_is_plain_zeros() -> None:
    t = cpu_zeros_on_huge_pages((3, 5), torch.float32)
    assert torch.equal(t, torch.zeros(3, 5))


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="the kernel gives no transparent huge pages")
def test_the_pool_lies_on_huge_pages_where_the_kernel_gives_them() -> None:
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=256,
                      tie_word_embeddings=False, attention_bias=False)
    caches = allocate_kv_caches(cfg, 1024, 16, torch.float32, torch.device("cpu"))  # 16 MiB in all
    start = caches[0][0].data_ptr()
    # khugepaged is not needed: the advice came before the first touch, so the faults were huge.
    assert huge_kib_under(start, 16 << 20) >= 8 * 1024
    assert all(float(k.abs().sum()) == 0.0 and float(v.abs().sum()) == 0.0 for k, v in caches)
