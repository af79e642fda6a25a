"""An flock that one process at a time holds, waited for up to a deadline.

The C++ op builds (pdserve/kernels/cpp_build.py) and the GGUF conversion of a model
(workers/model/resolve.py) each run once per machine while every process that
starts at the same time waits for it. An flock, unlike a file made with O_EXCL,
goes with the process that held it: a holder that was killed blocks no one.
Here, in the lowest layer, so that pdserve/kernels/ and workers/ both may import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

POLL_S = 0.2  # between tries while another process holds the lock


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str], wait_s: float) -> Iterator[None]:
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
                    raise TimeoutError(f"another process held {os.fspath(path)} for over {wait_s:.0f} s") from None
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
