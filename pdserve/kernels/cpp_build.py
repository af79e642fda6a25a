"""Build a C++ op with torch.utils.cpp_extension the first time a process needs it.

The CPU ops (pdserve/kernels/cpu_decode.py, pdserve/kernels/cpu_linear.py) are C++ sources compiled for this
machine's CPU (a C++ compiler and ninja, as Inductor needs; a few seconds once, then cached under
~/.cache/torch_extensions). Each registers one operator with the dispatcher from C++
(TORCH_LIBRARY, `torch.ops.pdserve.<name>`) and includes only ATen's headers: no pybind11 module,
whose torch/extension.h was 17 s of a 20 s build on a 2-core AMD EPYC (and ~11 minutes on a slow
machine); a call through the dispatcher costs ~1 us more than through a binding. Anything that
stops the build leaves `load()` returning None, with one warning, and the caller on its PyTorch
path. Each op has an environment switch that turns it off.

Builds are serialized across processes by an flock in the build folder, not only by torch's own
`lock` file: torch makes that file with O_EXCL and removes it when its build ends, so a process
killed while it builds (a first server start stopped at its deadline, a worker killed) leaves it
behind, and every later process waits on it for ever. An flock goes with the process that held it;
whoever holds it knows that a `lock` file left there is such an orphan, and removes it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from pdserve.kernels.file_lock import exclusive

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


Op = torch._ops.OpOverload  # what `load()` hands out: call it like the C++ function


class InlineOp:
    """One C++ source defining the operator `pdserve::<op>`: built (or loaded from torch's cache)
    on the first `load()`.

    The build's name carries a hash of the source, the flags and this CPU's features: an edited
    kernel never loads an old build, and a cache shared by unlike machines never loads another
    CPU's build."""

    def __init__(self, stem: str, source: str, env: str, what: str, op: str) -> None:
        self.source, self.env, self.what, self.op = source, env, what, op
        digest = hashlib.sha256((source + " ".join(FLAGS) + _cpu_flags()).encode()).hexdigest()[:12]
        self.name = f"{stem}_{digest}"
        self._lock = threading.Lock()
        self._built: Op | None = None
        self._tried = False

    def enabled(self) -> bool:
        return os.environ.get(self.env, "1") != "0"

    def built(self) -> Op | None:
        """The operator if a `load()` built it, whatever the switch says now: a layer that chose
        the op at load keeps it (and a hot path reads no environment)."""
        return self._built

    def load(self) -> Op | None:
        """The built operator, building it on first use; None if it cannot be built (or is off:
        the switch is read on every call, so turning it off takes effect after a build too)."""
        if not self.enabled():
            return None
        if self._tried:
            return self._built
        with self._lock:
            if not self._tried:
                start = time.perf_counter()
                log.info("preparing %s (a first build takes seconds)", self.what)
                try:
                    self._built = self._build()
                    log.info("%s ready in %.1f s", self.what, time.perf_counter() - start)
                except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a build error: PyTorch's path works
                    log.warning("%s unavailable (%s); using PyTorch's path", self.what, e)
                self._tried = True
        return self._built

    def _build(self) -> Op:
        from torch.utils import cpp_extension

        build_dir = cpp_extension._get_build_directory(self.name, verbose=False)  # torch's cache folder for it
        os.makedirs(build_dir, exist_ok=True)
        with exclusive(os.path.join(build_dir, "pdserve.flock"), BUILD_WAIT_S):
            orphan = os.path.join(build_dir, _BATON)
            if os.path.exists(orphan):  # every builder holds the flock first: this one's process is gone
                log.warning("%s: removing %s, left by a build that was killed", self.what, orphan)
                os.remove(orphan)
            # Not load_inline: it puts torch/extension.h in front of the source. Rewritten only when
            # it changed, so that torch's check of the sources finds the build up to date.
            source = Path(build_dir) / "op.cpp"
            if not source.exists() or source.read_text(encoding="utf-8") != self.source:
                source.write_text(self.source, encoding="utf-8")
            # is_python_module=False: the library is loaded into the process (torch.ops.load_library),
            # which registers the op
            cpp_extension.load(self.name, sources=[str(source)], extra_cflags=FLAGS, build_directory=build_dir,
                               is_python_module=False, verbose=False)
        return getattr(torch.ops.pdserve, self.op).default  # type: ignore[no-any-return]


__all__ = ["FLAGS", "InlineOp", "Op"]
