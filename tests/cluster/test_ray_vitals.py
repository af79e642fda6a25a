"""The driver's watch on local Ray's GCS and raylet (cluster/ray_vitals.py): nothing replaces
either, so their loss must be seen (a zombie too: the driver is their parent, and Ray reaps
them late) and acted on once; and the drain flag that needs no GCS (cluster/drain_flag.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster import drain_flag, ray_vitals
from pdserve.cluster.ray_vitals import Vital, VitalsWatch, find_vitals
from pdserve.cluster.shutdown import descendants


@pytest.fixture(autouse=True)
def no_loss_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch's loss is the process's (`ray_vitals.lost`): each test starts with none, and leaves none."""
    monkeypatch.setattr(ray_vitals, "_lost", None)


@pytest.fixture
def fake_ray(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """Children of this process named as local Ray's GCS and raylet (`sleep` under their names),
    and one that is neither."""
    procs = {}
    for name in ("gcs_server", "raylet", "log_monitor"):
        exe = tmp_path / name
        exe.symlink_to("/bin/sleep")
        procs[name] = subprocess.Popen([str(exe), "60"])
    yield procs
    for p in procs.values():
        p.kill()
        p.wait()


def test_the_gcs_and_the_raylet_are_found_among_this_process_s_descendants(
        fake_ray: dict[str, subprocess.Popen[bytes]]) -> None:
    found = {v.name: v.pid for v in find_vitals()}
    assert found == {"gcs_server": fake_ray["gcs_server"].pid, "raylet": fake_ray["raylet"].pid}


def test_a_killed_one_is_seen_even_unreaped_and_reported_once(fake_ray: dict[str, subprocess.Popen[bytes]]) -> None:
    calls: list[tuple[Vital, float]] = []
    VitalsWatch(find_vitals(), lambda v: calls.append((v, time.monotonic())), poll_s=0.05).start()
    time.sleep(0.3)
    assert not calls and ray_vitals.lost() is None  # both alive: nothing said
    killed = time.monotonic()
    os.kill(fake_ray["raylet"].pid, signal.SIGKILL)  # not reaped: a zombie, as Ray leaves it
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(fake_ray["gcs_server"].pid, signal.SIGKILL)  # after the first loss the watch has stopped
    time.sleep(0.3)
    assert len(calls) == 1
    vital, seen = calls[0]
    assert vital.name == "raylet" and vital.pid == fake_ray["raylet"].pid and ray_vitals.lost() == vital
    assert seen - killed < 1.0
    assert "raylet" in vital.describe() and str(vital.pid) in vital.describe()


def test_a_reused_pid_is_not_the_process_that_was_watched() -> None:
    """Watched by (pid, start time): a pid the kernel gave to another process is a loss."""
    pid = os.getpid()
    started = descendants(os.getppid())[pid]
    calls: list[Vital] = []
    VitalsWatch([Vital("gcs_server", pid, started + 1)], calls.append, poll_s=0.02).start()
    time.sleep(0.3)
    assert [v.pid for v in calls] == [pid]


def test_every_thread_of_the_process_is_put_behind() -> None:
    """Linux keeps nice per thread: Ray's busy threads are not the caller's."""
    code = (
        "import os, threading, time\n"
        "from pdserve.cluster.ray_vitals import nice_all_threads\n"
        "stop = threading.Event()\n"
        "ts = [threading.Thread(target=stop.wait) for _ in range(3)]\n"
        "[t.start() for t in ts]\n"
        "nice_all_threads(7)\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}))\n"
        "stop.set()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[7]"


def test_the_drain_file_is_raised_without_the_gcs_and_lowered_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain_flag.tempfile, "gettempdir", lambda: str(tmp_path))
    port = 18_001
    assert not drain_flag.file_raised(port)
    drain_flag.raise_flag(port, gcs=False)  # no Ray in this process, and it must not be asked
    assert drain_flag.file_raised(port)
    drain_flag.lower_flag(port)
    assert not drain_flag.file_raised(port)


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's needs root")
def test_a_drain_file_another_user_made_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain_flag.tempfile, "gettempdir", lambda: str(tmp_path))
    path = Path(drain_flag.flag_path(18_002))
    path.touch()
    os.chown(path, 65534, -1)
    assert not drain_flag.file_raised(18_002)


def test_the_watch_reads_the_file_while_a_read_of_the_gcs_hangs() -> None:
    """With the GCS gone a read of its key blocks for a minute: the file is read all the same."""
    release = threading.Event()
    file_up = threading.Event()
    drained: list[float] = []

    def gcs_read(port: int) -> bool:
        release.wait(10)
        return False

    async def main() -> float:
        watch = drain_flag.DrainWatch(1, lambda: drained.append(time.monotonic()), poll_s=0.02,
                                      read=gcs_read, read_file=lambda port: file_up.is_set())
        watch.start()
        await asyncio.sleep(0.2)
        assert not drained
        t = time.monotonic()
        file_up.set()
        await asyncio.sleep(0.2)
        await watch.close()
        return t

    raised = asyncio.run(main())
    release.set()
    assert len(drained) == 1 and drained[0] - raised < 0.15
