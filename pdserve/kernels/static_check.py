"""Compile a Triton kernel for a GPU that is not here, and read what it costs.

Triton compiles ahead of time without a device: the front end, the NVIDIA
backend and the bundled ptxas run on any machine. What comes back is static
but real: registers per thread, spilled bytes, shared memory per program,
whether the loads of the KV loop became asynchronous copies (software
pipelining), whether the dots became Hopper `wgmma`, and from those the
number of programs one SM can hold. It says nothing about speed; it tells a
config that cannot run well (spills, one program per SM, synchronous loads)
from one that can, before a GPU is lent to time them.

The kernels are specialised the way the JIT specialises them at run time:
pointers and strides divisible by 16, unit strides folded to the constant 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.kernels.configs import DecodeConfig, PrefillConfig

# Per-SM limits of the targets we check (CUDA occupancy tables): H100/H200,
# A100, A10/RTX 30xx, L4/RTX 40xx.
_SM_LIMITS = {
    90: dict(regs=65536, smem=233472, smem_per_block_reserved=1024, max_warps=64, max_blocks=32),
    80: dict(regs=65536, smem=167936, smem_per_block_reserved=1024, max_warps=64, max_blocks=32),
    86: dict(regs=65536, smem=102400, smem_per_block_reserved=1024, max_warps=48, max_blocks=16),
    89: dict(regs=65536, smem=102400, smem_per_block_reserved=1024, max_warps=48, max_blocks=24),
}
# The most shared memory one program may use, per target.
SMEM_PER_BLOCK = {90: 232448, 80: 166912, 86: 101376, 89: 101376}

_TRITON_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class StaticReport:
    """What one compiled variant costs on an SM."""

    regs: int  # per thread
    spill_bytes: int  # local-memory stack per thread (0 = no spills)
    smem: int  # bytes per program
    async_copies: int  # cp.async instructions in the PTX (pipelined loads)
    sync_loads: int  # ld.global instructions (loads the pipeliner left synchronous)
    wgmma: int  # Hopper warp-group MMA instructions
    mma_sync: int  # Ampere-style mma.sync instructions
    programs_per_sm: int
    limit: str  # what bounds programs_per_sm: regs | smem | warps | blocks

    def row(self) -> str:
        return (f"regs {self.regs:>3}  spill {self.spill_bytes:>4} B  smem {self.smem / 1024:6.1f} KiB  "
                f"{self.programs_per_sm} prog/SM ({self.limit:<5})  cp.async {self.async_copies:>3}  "
                f"ld.global {self.sync_loads:>3}  wgmma {self.wgmma:>3}  mma.sync {self.mma_sync:>3}")


def occupancy(regs: int, smem: int, num_warps: int, arch: int = 90) -> tuple[int, str]:
    """Programs (CTAs) per SM and the resource that bounds it."""
    lim = _SM_LIMITS[arch]
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    bounds = {
        "regs": lim["regs"] // (regs_per_warp * num_warps),
        "smem": lim["smem"] // (smem + lim["smem_per_block_reserved"]),
        "warps": lim["max_warps"] // num_warps,
        "blocks": lim["max_blocks"],
    }
    name = min(bounds, key=lambda k: bounds[k])
    return bounds[name], name


def triton_dtype(dtype: torch.dtype) -> str:
    return _TRITON_DTYPES[dtype]


def _tool(name: str) -> str:
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def available() -> bool:
    """Whether this Triton can compile for NVIDIA here (its bundled ptxas/cuobjdump)."""
    try:
        return os.access(_tool("ptxas"), os.X_OK) and os.access(_tool("cuobjdump"), os.X_OK)
    except ImportError:
        return False


def compile_static(
    fn: Any,  # a @triton.jit function
    pointers: dict[str, str],
    constexprs: dict[str, object],
    *,
    floats: tuple[str, ...] = (),
    unit_strides: tuple[str, ...] = (),
    num_warps: int,
    num_stages: int,
    arch: int = 90,
) -> StaticReport:
    """Compile `fn` (a @triton.jit function) for sm_`arch` and report its costs.

    pointers: argument -> Triton pointer type ("*bf16"); floats: fp32 scalars;
    unit_strides: integer arguments the JIT would see as 1 (folded to constants);
    every other non-constexpr argument is an int32 divisible by 16.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(constexprs)
    consts.update({name: 1 for name in unit_strides})
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    divisible = [n for n in fn.arg_names if signature[n] == "i32" or signature[n].startswith("*")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {usage[:200]!r}")
    regs, stack = int(m.group(1)), int(m.group(2))
    smem = int(kernel.metadata.shared)
    ptx = kernel.asm["ptx"]
    per_sm, limit = occupancy(regs, smem, num_warps, arch)
    return StaticReport(
        regs=regs, spill_bytes=stack, smem=smem,
        async_copies=len(re.findall(r"cp\.async\.c[ag]", ptx)),
        sync_loads=len(re.findall(r"\bld\.global", ptx)),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        programs_per_sm=per_sm, limit=limit,
    )


# ---------------------------------------------------------------- our kernels

def decode_report(config: DecodeConfig, *, head_dim: int, group: int, max_q: int, dtype: torch.dtype,
                  num_splits: int = 1, arch: int = 90) -> StaticReport:
    """Static cost of `triton_decode`'s stage 1 under `config` (a DecodeConfig)."""
    from pdserve.kernels import triton_decode

    t = triton_dtype(dtype)
    pointers = {n: f"*{t}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    pointers.update(bt_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", ws_acc_ptr="*fp32", ws_lse_ptr="*fp32")
    return compile_static(
        triton_decode._decode_stage1, pointers,
        dict(GROUP=group, MAX_Q=max_q, BLOCK_M=triton_decode.block_m_for(max_q, group), HEAD_DIM=head_dim,
             TILE=config.tile_n, NUM_SPLITS=num_splits, DOT_PRECISION=triton_decode.dot_precision(dtype)),
        floats=("qk_scale",), unit_strides=("stride_qd", "stride_kd", "stride_vd", "stride_btb", "stride_od"),
        num_warps=config.num_warps, num_stages=config.num_stages, arch=arch,
    )


def prefill_report(config: PrefillConfig, *, head_dim: int, group: int, dtype: torch.dtype,
                   arch: int = 90) -> StaticReport:
    """Static cost of `triton_prefill`'s kernel under `config` (a PrefillConfig)."""
    import triton

    from pdserve.kernels import triton_prefill

    t = triton_dtype(dtype)
    group_pad = triton.next_power_of_2(group)
    pointers = {n: f"*{t}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    pointers.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32")
    return compile_static(
        triton_prefill._prefill_kernel, pointers,
        dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
             BLOCK_Q=config.block_m // group_pad, BLOCK_M=config.block_m, TILE_N=config.tile_n,
             DOT_PRECISION=triton_prefill.dot_precision(dtype, cuda=True)),
        floats=("qk_scale",), unit_strides=("stride_qd", "stride_od", "stride_kcd", "stride_vcd", "stride_btb"),
        num_warps=config.num_warps, num_stages=config.num_stages, arch=arch,
    )


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class Request:
    """One compile: kernel "decode" | "prefill", its config's fields, the shape."""

    kernel: str
    config: tuple[int, ...]  # DecodeConfig or PrefillConfig fields, in order
    head_dim: int
    group: int
    dtype: str = "bf16"
    max_q: int = 1  # decode only
    arch: int = 90


def _one(req: Request) -> StaticReport:
    from pdserve.kernels import configs

    dtype = {v: k for k, v in _TRITON_DTYPES.items()}[req.dtype]
    if req.kernel == "decode":
        return decode_report(configs.DecodeConfig(*req.config), head_dim=req.head_dim, group=req.group,
                             max_q=req.max_q, dtype=dtype, arch=req.arch)
    if req.kernel == "prefill":
        return prefill_report(configs.PrefillConfig(*req.config), head_dim=req.head_dim, group=req.group,
                              dtype=dtype, arch=req.arch)
    raise ValueError(f"unknown kernel {req.kernel!r}")


def compile_batch(requests: list[Request], timeout_s: float = 900.0) -> list[StaticReport]:
    """Reports for `requests`, in order.

    Triton's interpreter mode (TRITON_INTERPRET=1, how the CPU tests run the
    kernels) replaces every @triton.jit function, its own library's included,
    with an interpreter object that cannot be compiled; then the batch runs in
    a child process with the interpreter off."""
    import triton

    if not triton.knobs.runtime.interpret:
        return [_one(r) for r in requests]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One child per core: a compile is single-threaded (MLIR, then ptxas), so a cold batch
    # (37 s in CI for the tests' 33 kernels) takes about 1/cores as long. Requests are dealt
    # round-robin: the sweep's neighbours cost alike.
    parts = max(1, min(len(requests), os.cpu_count() or 1, 8))

    def child(part: list[Request]) -> list[StaticReport]:
        proc = subprocess.run([sys.executable, "-m", "pdserve.kernels.static_check"], env=env, timeout=timeout_s,
                              input=json.dumps([asdict(r) for r in part]), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"static compile failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return [StaticReport(**r) for r in json.loads(proc.stdout)]

    with ThreadPoolExecutor(parts) as pool:
        dealt = list(pool.map(child, [requests[i::parts] for i in range(parts)]))
    return [dealt[i % parts][i // parts] for i in range(len(requests))]


if __name__ == "__main__":
    # The child side of compile_batch: JSON requests on stdin, JSON reports on stdout.
    reqs = [Request(**{**r, "config": tuple(r["config"])}) for r in json.load(sys.stdin)]
    print(json.dumps([asdict(_one(r)) for r in reqs]))
