"""A blocking call that may never return, given a deadline: run on a daemon thread and waited for.

Why: some of Ray Serve's calls wait on its controller with no timeout of their own
(`serve.start`'s, `serve.run_many`'s and `serve.status`'s `ray.get`s in Ray 2.60); a controller
that is stopped or wedged would hold `pdserve serve`'s start for ever, past the deadline its
loop checks only between calls. A call past its deadline is left behind on its daemon thread
(nothing can interrupt it; the process is about to report the failure and exit) and the
caller gets a TimeoutError naming what did not answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_within(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()`'s result, or its exception, if it returns within `timeout_s`; else TimeoutError."""
    done = threading.Event()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"pdserve-call-{what[:20]}", daemon=True).start()
    if not done.wait(max(0.0, timeout_s)):
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s")
    if error:
        raise error[0]
    return result[0]
