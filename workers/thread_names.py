"""Names a thread for the OS as well as for Python, so `top -H`, `ps -L`, py-spy and
/proc/<pid>/task/<tid>/comm tell a worker's engine, KV receiver and KV senders apart (Python
3.11 names only its own Thread objects: every thread of a Ray worker shows the process's
title, `ray::IDLE`). Linux only; elsewhere a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, at most 15 bytes
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # no libc to load: the names stay as they are
        _libc = None


def name_os_thread(name: str) -> bool:
    """Name the calling thread `name` (cut to 15 bytes) for the OS; whether it took."""
    if _libc is None:
        return False
    return int(_libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)) == 0
