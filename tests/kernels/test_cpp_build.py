"""pdserve/kernels/cpp_build.py: a build killed half-way does not make every later process wait for ever.

torch's own build lock is a file made with O_EXCL and removed when its build ends; a process
killed while building leaves it, and torch's next load of that op waits on it with no deadline
(a worker restarted after such a kill would hang at start). Builds are faked where what is tested is
what happens around torch's call; one small op is built for real."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import cpp_extension

from pdserve.kernels import cpp_build
from pdserve.kernels.cpp_build import InlineOp
from pdserve.kernels.file_lock import exclusive


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


SOURCE = """#include <torch/library.h>
static at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
TORCH_LIBRARY_FRAGMENT(pdserve, m) { m.def("test_twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("test_twice", &twice); }
"""


def _fake_load(calls: list[dict[str, Any]]) -> Any:
    def load(name: str, **kwargs: Any) -> str:
        # torch waits while its lock file exists: the op must be free of it by now.
        assert not os.path.exists(os.path.join(kwargs["build_directory"], "lock"))
        calls.append({"name": name, **kwargs})
        return name
    return load


def test_a_lock_left_by_a_killed_build_is_removed_and_the_op_builds(build_root: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # An op name that exists already (the fake build registers nothing): pdserve's own CPU op.
    op = InlineOp("pdserve_test_op", SOURCE, "PDSERVE_TEST_OP", "a test op", "paged_attention")
    build_dir = Path(cpp_extension._get_build_directory(op.name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").touch()  # what a build killed half-way leaves
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(calls))
    import pdserve.workers.model.compiled  # noqa: F401  # defines pdserve::paged_attention

    assert op.load() is not None
    assert len(calls) == 1 and calls[0]["build_directory"] == str(build_dir)
    assert calls[0]["extra_cflags"] == cpp_build.FLAGS and not calls[0]["is_python_module"]
    assert calls[0]["sources"] == [str(build_dir / "op.cpp")] and (build_dir / "op.cpp").read_text() == SOURCE
    assert build_dir.is_relative_to(build_root)


def test_an_op_builds_registers_itself_and_is_found_in_the_cache_the_next_time(build_root: Path) -> None:
    """A real build of a small op (its headers only: seconds), called through the dispatcher; a
    second InlineOp of the same source (another process, a restart) loads the cached build."""
    op = InlineOp("pdserve_test_op", SOURCE, "PDSERVE_TEST_OP", "a test op", "test_twice")
    twice = op.load()
    assert twice is not None, "the test op did not build (a C++ compiler and ninja are needed)"
    x = torch.arange(4.0)
    assert torch.equal(twice(x), 2 * x) and torch.equal(torch.ops.pdserve.test_twice(x), 2 * x)
    library = next(Path(cpp_extension._get_build_directory(op.name, verbose=False)).glob("*.so"))
    built_at = library.stat().st_mtime_ns
    assert InlineOp("pdserve_test_op", SOURCE, "PDSERVE_TEST_OP", "a test op", "test_twice").load() is not None
    assert library.stat().st_mtime_ns == built_at  # not rebuilt


def _hold(path: str, held: Any, release: Any) -> None:
    with exclusive(path, 5.0):
        held.set()
        release.wait(10.0)


@contextlib.contextmanager
def _holder(path: str) -> Iterator[tuple[Any, Any]]:
    """Another process holding the flock at `path` (as a build would), until `release` (or killed)."""
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(path, held, release), daemon=True)
    proc.start()
    try:
        assert held.wait(60.0)
        yield proc, release
    finally:
        if proc.is_alive():  # (a killed process may have left the event's lock taken: not touched then)
            release.set()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()


def test_a_build_in_another_process_is_waited_for_up_to_the_deadline(tmp_path: Path) -> None:
    """While a live process builds (holds the flock), another waits, and gives up at its deadline."""
    path = str(tmp_path / "pdserve.flock")
    with _holder(path) as (proc, release):
        start = time.monotonic()
        with pytest.raises(TimeoutError), exclusive(path, 0.6):
            pass
        assert time.monotonic() - start >= 0.6
        release.set()
        proc.join(10.0)
        with exclusive(path, 5.0):  # let go by its holder: taken at once
            pass


def test_a_killed_holder_lets_go(tmp_path: Path) -> None:
    """The flock goes with its process: a builder killed while it holds it blocks no one."""
    path = str(tmp_path / "pdserve.flock")
    with _holder(path) as (proc, _):
        proc.kill()
        proc.join(10.0)
        with exclusive(path, 5.0):
            pass
