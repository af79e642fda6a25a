"""Build on a thread that exits, so the engine thread is the process's only OpenMP master.

libgomp keeps a pool of worker threads for every thread that ever ran a
parallel region, until that thread exits. Once the threads it manages
outnumber the CPUs it may use, every wait spins ~1,000 times instead of
~300,000 before sleeping on a futex: the engine thread's OpenMP workers then
sleep between the model's parallel regions and are woken for each, late
whenever another process has their core. A served worker built its engine
(load, compile, warm-up: many parallel regions) on the actor's thread, then
stepped it on the engine thread: two pools, 3 managed threads on 2 cores, and
the engine thread's worker at 78% of a core where the offline engine's is at
100% (docs/performance.md). Built on a thread that exits, the first pool
goes with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def run_on_exiting_thread(fn: Callable[[], T], torch_threads: int, name: str = "pdserve-build") -> T:
    """`fn()` on a new thread with `torch_threads` intra-op threads; its result, or its
    exception re-raised here, once the thread has exited (and its OpenMP pool with it)."""
    box: dict[str, object] = {}

    def run() -> None:
        torch.set_num_threads(torch_threads)  # OpenMP's count is per thread: set it where the work runs
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
