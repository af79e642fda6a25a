"""run_on_exiting_thread: the work runs on a thread that is gone when it returns, with the
thread count asked for; its result or its exception reaches the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.workers.cpu_threads import run_on_exiting_thread


def test_runs_on_a_thread_that_has_exited_with_its_thread_count() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return torch.get_num_threads()

    assert run_on_exiting_thread(work, 1) == 1
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_the_work_s_exception_is_raised_to_the_caller() -> None:
    def work() -> None:
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        run_on_exiting_thread(work, 1)
