"""Worker threads carry OS names (what `top -H`, py-spy and bench/serving_profile.py's thread
table show), not the process's title."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from pdserve.workers.thread_names import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names via prctl are Linux's")


def _os_name_of_a_thread(name: str) -> str:
    seen: list[str] = []

    def run() -> None:
        name_os_thread(name)
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    return seen[0]


def test_a_thread_names_itself_for_the_os_without_renaming_the_process() -> None:
    before = Path("/proc/self/comm").read_text().strip()
    assert _os_name_of_a_thread("pd-engine") == "pd-engine"
    assert Path("/proc/self/comm").read_text().strip() == before  # the main thread keeps its name


def test_a_long_name_is_cut_to_the_kernels_15_bytes() -> None:
    assert _os_name_of_a_thread("pd-kv-recv tcp://127.0.0.1:5555") == "pd-kv-recv tcp:"
