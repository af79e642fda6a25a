"""Build a C++ op with torch.utils.cpp_extension the first time a process needs it.

The CPU ops (kernels/cpu_decode.py, kernels/cpu_linear.py) are C++ sources compiled for this
machine's CPU (a C++ compiler and ninja, as Inductor needs; ~20-60 s once, then cached under
~/.cache/torch_extensions). Anything that stops the build leaves `load()` returning None, with one
warning, and the caller on its PyTorch path. Each op has an environment switch that turns it off.

Builds are serialized across processes by an flock in the build folder, not only by torch's own
`lock` file: torch makes that file with O_EXCL and removes it when its build ends, so a process
killed while it builds (a first server start stopped at its deadline, a worker killed) leaves it
behind, and every later process waits on it for ever. An flock goes with the process that held it;
whoever holds it knows that a `lock` file left there is such an orphan, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from types import ModuleType

log = logging.getLogger(__name__)

# -march=native: the vector loops compile for this machine's CPU (AVX2/AVX-512/NEON); -ffast-math
# lets the compiler reorder float sums and contract multiply-adds (the ops keep no NaN or infinity
# to honour: their inputs are finite); -fopenmp: without it at::parallel_for, a header template,
# compiles to a serial loop (the symbols resolve to the OpenMP runtime torch already loaded).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# How long a process waits for another one's build of the same op (a first build on a slow 2-core
# machine takes minutes); then it gives up on the op, and its caller takes the PyTorch path.
BUILD_WAIT_S = 1800.0
_BATON = "lock"  # torch.utils.file_baton's file in the build folder


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


class InlineOp:
    """One C++ extension: built (or loaded from torch's cache) on the first `load()`.

    The build's name carries a hash of the source, the flags and this CPU's features: an edited
    kernel never loads an old build, and a cache shared by unlike machines never loads another
    CPU's build."""

    def __init__(self, stem: str, source: str, env: str, what: str) -> None:
        self.source, self.env, self.what = source, env, what
        digest = hashlib.sha256((source + " ".join(FLAGS) + _cpu_flags()).encode()).hexdigest()[:12]
        self.name = f"{stem}_{digest}"
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False

    def enabled(self) -> bool:
        return os.environ.get(self.env, "1") != "0"

    def built(self) -> ModuleType | None:
        """The module if a `load()` built it, whatever the switch says now: a layer that chose
        the op at load keeps it (and a hot path reads no environment)."""
        return self._module

    def load(self) -> ModuleType | None:
        """The built module, building it on first use; None if it cannot be built (or is off:
        the switch is read on every call, so turning it off takes effect after a build too)."""
        if not self.enabled():
            return None
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                start = time.perf_counter()
                log.info("preparing %s (a first build on this machine takes ~1 min)", self.what)
                try:
                    self._module = self._build()
                    log.info("%s ready in %.1f s", self.what, time.perf_counter() - start)
                except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: PyTorch's path works
                    log.warning("%s unavailable (%s); using PyTorch's path", self.what, e)
                self._tried = True
        return self._module

    def _build(self) -> ModuleType:
        from torch.utils import cpp_extension

        build_dir = cpp_extension._get_build_directory(self.name, verbose=False)  # torch's cache folder for it
        os.makedirs(build_dir, exist_ok=True)
        with _exclusive(os.path.join(build_dir, "pdserve.flock"), BUILD_WAIT_S):
            orphan = os.path.join(build_dir, _BATON)
            if os.path.exists(orphan):  # every builder holds the flock first: this one's process is gone
                log.warning("%s: removing %s, left by a build that was killed", self.what, orphan)
                os.remove(orphan)
            module: ModuleType = cpp_extension.load_inline(  # type: ignore[no-untyped-call]
                self.name, cpp_sources=self.source, extra_cflags=FLAGS, build_directory=build_dir, verbose=False)
            return module


@contextlib.contextmanager
def _exclusive(path: str, wait_s: float) -> Iterator[None]:
    """Hold an flock on `path` (made if absent), waiting up to `wait_s` for another process to let
    go (TimeoutError then)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {path} for over {wait_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["FLAGS", "InlineOp"]
