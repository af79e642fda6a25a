"""The engine thread computes with the torch threads its worker was given.

OpenMP's thread count is per thread: a new thread starts from OMP_NUM_THREADS, which Ray sets to 1
in every worker process, not from what `torch.set_num_threads` set in the thread that built the
engine (torch.get_num_threads() still reports the latter). Served workers ran their model on one
core whatever they were given until the engine thread set its own count. Checked in a child process
started with OMP_NUM_THREADS=1, as a Ray worker is, by asking OpenMP itself on the engine thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from factories import tiny_spec

from pdserve.workers.tiny.builder import TinyModelSpec

CHILD = """
import asyncio, ctypes, sys, torch
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine

def omp_max_threads():
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if any(name in path for name in ("libgomp", "libiomp", "libomp")):
            return ctypes.CDLL(path).omp_get_max_threads
    return None

probe = omp_max_threads()
if probe is None:
    print("no-openmp"); sys.exit(0)
torch.set_num_threads(2)  # what the worker's constructor does with its share of the cores
engine = AsyncEngine(LLMEngine(EngineConfig(model=sys.argv[1], max_model_len=64, num_kv_blocks=16))).start()

async def main():
    return await engine.call(lambda _engine: probe())

print("engine-thread", asyncio.run(main()))
engine.close()
"""


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2))


def test_the_engine_thread_uses_the_workers_torch_threads(model_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as Ray sets it in a worker process
    out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if "no-openmp" in out.stdout:
        pytest.skip("this torch build has no OpenMP runtime to ask")
    assert out.stdout.split()[-1] == "2", out.stdout
