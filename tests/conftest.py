"""Shared factories: a per-session cache dir, tiny models by spec, engines."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; the switch must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines run eagerly unless a test asks for the compiled model (tests/workers/
# test_compiled.py): compiling each of the suite's hundreds of tiny engines
# would take longer than running them. Set before any engine (or Ray worker,
# which inherits the environment) is made.
os.environ.setdefault("PDSERVE_ENFORCE_EAGER", "1")
# float32 unless a test asks for another dtype: `dtype="auto"` picks bfloat16 only on CPUs with
# AMX/AVX512-BF16, and the suite's oracles (transformers in float32, greedy equality across
# batching, migration and resume) are float32 properties; bfloat16 has its own tests against
# transformers in bfloat16 (tests/workers/test_cpu_bfloat16.py).
os.environ.setdefault("PDSERVE_DTYPE", "float32")

from pdserve.workers.tiny.builder import TinyModelSpec, make_tiny_model

# Keep CPU op timing and float reductions stable across the suite.
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point PDSERVE_CACHE_DIR at a session temp dir: the tokenizer trains once per run,
    and nothing is written to the real ~/.cache."""
    path = tmp_path_factory.mktemp("pdserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def make_model(tmp_path_factory: pytest.TempPathFactory, session_cache: Path) -> Callable[[TinyModelSpec], Path]:
    """Build each distinct spec once per session and hand out its directory."""
    made: dict[TinyModelSpec, Path] = {}

    def get(spec: TinyModelSpec) -> Path:
        if spec not in made:
            made[spec] = make_tiny_model(tmp_path_factory.mktemp("model") / "m", spec, progress=False)
        return made[spec]

    return get


@pytest.fixture(scope="module", autouse=True)
def no_engine_thread_left_running() -> Iterator[None]:
    """Every test closes the engines it starts (`AsyncEngine.close`, a worker's or
    service's `close`): an idle engine thread left behind wakes ten times a
    second, and the GIL hand-offs it forces skew what later tests time."""
    yield
    # (By name, not by importing async_engine here: that import slows the timed bench tests.)
    left = [t for t in threading.enumerate() if t.name == "pdserve-engine" and t.is_alive()]
    assert not left, f"{len(left)} engine thread(s) left running by this module: close what you start"
