"""The attention kernels compiled for an H100 (sm_90) without one: Triton's
bundled ptxas runs here. What a compile tells is static (registers, spills,
shared memory, how the loads were lowered), so these tests hold the configs
to what a GPU run needs to be possible at all: no register spills, shared
memory within one SM, and for the defaults the properties the design relies
on (docs/kernels.md). Speed is for `bench/kernels_gpu.py` on a lent GPU.
"""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest
import torch

from pdserve.kernels import configs, static_check

pytestmark = pytest.mark.skipif(not static_check.available(), reason="Triton without its bundled NVIDIA tools")

SMEM_PER_SM_H100 = 227 * 1024  # the most one program may use
LLAMA3_8B = dict(group=4, head_dim=128)  # 32 query / 8 KV heads


def _decode(cfg: configs.DecodeConfig, head_dim: int = 128, max_q: int = 1) -> static_check.Request:
    return static_check.Request("decode", astuple(cfg), head_dim, LLAMA3_8B["group"], max_q=max_q)


def _prefill(cfg: configs.PrefillConfig, head_dim: int = 128) -> static_check.Request:
    return static_check.Request("prefill", astuple(cfg), head_dim, LLAMA3_8B["group"])


DECODE_DEFAULT = configs.decode_config(128, torch.bfloat16)
REQUESTS = (
    [_decode(c) for c in configs.DECODE_SWEEP]
    + [_prefill(c) for c in configs.PREFILL_SWEEP]
    + [_decode(DECODE_DEFAULT), _decode(replace(DECODE_DEFAULT, num_stages=2))]
    + [_decode(configs.decode_config(d, torch.bfloat16), d, rows) for d, rows in ((128, 5), (64, 1), (64, 5))]
    + [_prefill(configs.prefill_config(4, d, 1 << 14, torch.bfloat16, 90), d) for d in (64, 128)]
    + [replace(_decode(DECODE_DEFAULT), arch=a) for a in (80, 86, 89)]
    + [replace(_prefill(configs.prefill_config(4, 128, 1 << 14, torch.bfloat16)), arch=a) for a in (80, 86, 89)]
)


@pytest.fixture(scope="module")
def reports() -> dict[static_check.Request, static_check.StaticReport]:
    """Everything compiled at once (one child process under the interpreter)."""
    unique = list(dict.fromkeys(REQUESTS))
    return dict(zip(unique, static_check.compile_batch(unique)))


def _ok(report: static_check.StaticReport) -> None:
    assert report.spill_bytes == 0, f"spills {report.spill_bytes} B per thread: {report.row()}"
    assert report.smem <= SMEM_PER_SM_H100, report.row()
    assert report.programs_per_sm >= 1, report.row()


@pytest.mark.parametrize("cfg", configs.DECODE_SWEEP, ids=lambda c: c.label())
def test_decode_sweep_compiles_without_spills(reports, cfg):
    _ok(reports[_decode(cfg)])


@pytest.mark.parametrize("cfg", configs.PREFILL_SWEEP, ids=lambda c: c.label())
def test_prefill_sweep_compiles_without_spills(reports, cfg):
    _ok(reports[_prefill(cfg)])


def test_decode_default_runs_batch_64_in_one_wave_with_pipelined_loads(reports):
    """Batch 64 x 8 KV heads = 512 programs; 132 SMs must hold them all at once,
    and the block-table loads must be pipelined with the K/V copies (3 stages)."""
    report = reports[_decode(DECODE_DEFAULT)]
    _ok(report)
    assert 132 * report.programs_per_sm >= 64 * 8, report.row()
    two_stage = reports[_decode(replace(DECODE_DEFAULT, num_stages=2))]
    assert report.sync_loads < two_stage.sync_loads, (report.row(), two_stage.row())


@pytest.mark.parametrize("head_dim,rows", [(128, 5), (64, 1), (64, 5)])
def test_decode_default_verify_rows_and_head_dim_64(reports, head_dim, rows):
    _ok(reports[_decode(configs.decode_config(head_dim, torch.bfloat16), head_dim, rows)])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_default_uses_wgmma(reports, head_dim):
    report = reports[_prefill(configs.prefill_config(4, head_dim, 1 << 14, torch.bfloat16, 90), head_dim)]
    _ok(report)
    assert report.wgmma > 0 and report.mma_sync == 0, report.row()


@pytest.mark.parametrize("arch", [80, 86, 89])
def test_defaults_fit_ampere_and_ada(reports, arch):
    """The same defaults on A100 (sm_80), A10 / RTX 30xx (sm_86), L4 / RTX 40xx
    (sm_89): no spills, shared memory within what one program may have there."""
    for req in (replace(_decode(DECODE_DEFAULT), arch=arch),
                replace(_prefill(configs.prefill_config(4, 128, 1 << 14, torch.bfloat16)), arch=arch)):
        report = reports[req]
        assert report.spill_bytes == 0 and report.programs_per_sm >= 1, report.row()
        assert report.smem <= static_check.SMEM_PER_BLOCK[arch], report.row()


def test_occupancy_arithmetic():
    # 64 registers x 8 warps = 16 Ki registers: 4 programs in 64 Ki.
    assert static_check.occupancy(64, 1024, 8) == (4, "regs")
    # 72 registers round up to 2304 per warp: 3 programs.
    assert static_check.occupancy(72, 1024, 8)[0] == 3
    # 100 KiB of shared memory: 2 programs in 228 KiB.
    assert static_check.occupancy(32, 100 * 1024, 4) == (2, "smem")
    assert static_check.occupancy(16, 0, 1) == (32, "blocks")
