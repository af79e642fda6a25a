"""Shared factories: a per-session cache dir, tiny models by spec, engines."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; the switch must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
def stop_leftover_engine_threads() -> Iterator[None]:
    """After each test module, stop the engine threads of any AsyncEngine it left
    running. Idle ones wake ten times a second, and the GIL hand-offs they force
    skew what later tests time (the speculative-decoding cost model measured
    drafting as dear with a dozen of them around)."""
    yield
    module = sys.modules.get("pdserve.workers.async_engine")
    if module is None:  # no engine can exist; importing it here slowed the timed bench tests
        return
    AsyncEngine = module.AsyncEngine  # noqa: N806
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which on lazy
        # module proxies imports things (and skewed the timed tests that followed).
        if type(obj) is AsyncEngine and obj._thread.is_alive():
            obj.shutdown()
