"""The driver watches the local Ray it started: its GCS and its raylet, by pid.

Why: local Ray has no fault tolerance for either. Measured on 2 cores with the tiny model and
SmolLM2 (2026-12-06, by hand; docs/reliability.md "Local Ray's own processes killed"):

- **The GCS SIGKILLed:** every process of Ray's waits 60 s for it to come back, then ends. For
  those 60 s /health said 200 "ok" and the last streams were then cut with nothing said. Worse,
  the driver's own Ray threads (its error and log listeners) poll the dead GCS in a busy loop: a
  whole core, so on two cores the streams in flight crawled (5 chunks in 9.5 s).
- **The raylet SIGKILLed:** nothing ends at all. /health said 200 "ok" for as long as anyone
  looked (12 minutes), and every request got 503 "no healthy worker".

Neither can be repaired from inside: the way back is a new start, which is a supervisor's job
(systemd's Restart=on-failure, a container's restart policy). So on either's end the driver says
which one went, puts its own threads at nice 19 (the busy loop then costs the engines nothing),
and starts the same stop as a SIGTERM's, with the drain flag in a file (the GCS may be what is
gone: cluster/drain_flag.py). The requests in flight get the drain to finish, or end with an
error event; then everything the driver started is stopped by pid and `pdserve serve` exits 1.

Only on local Ray (`pdserve serve` started it: its descendants). A Ray cluster it joined has its
own answers (GCS fault tolerance, a head node's restart), and its processes are not this one's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

from pdserve.cluster.shutdown import alive, descendants

log = logging.getLogger(__name__)
_lost: Vital | None = None  # the first loss any watch of this process saw (`lost`)

POLL_S = 1.0  # a read of two /proc entries; a loss is seen within this
# The executables' names (argv[0]'s last part), and what each is to a reader.
VITAL = {"gcs_server": "its GCS (the cluster's control plane)", "raylet": "its raylet (the node's scheduler)"}


@dataclasses.dataclass(frozen=True)
class Vital:
    """One of local Ray's processes that nothing replaces."""

    name: str  # a key of VITAL
    pid: int
    started: int  # clock ticks since boot (/proc/PID/stat): a reused pid is another process

    def describe(self) -> str:
        return f"{VITAL[self.name]}, pid {self.pid}"


class ControlPlaneLost(Exception):
    """The stop that a vital process's loss began has drained: what is left is to stop every
    process the driver started, by pid (Serve's and Ray's own shutdown need what is gone)."""

    def __init__(self, vital: Vital) -> None:
        super().__init__(f"local Ray lost {vital.describe()}")
        self.vital = vital


def lost() -> Vital | None:
    """The vital process this process's watch found gone, if any."""
    return _lost


def _executable(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""
    return os.path.basename(argv0)


def find_vitals(root: int | None = None) -> list[Vital]:
    """Local Ray's GCS and raylet among the descendants of `root` (default: this process)."""
    found = descendants(os.getpid() if root is None else root)
    return [Vital(name, pid, started) for pid, started in sorted(found.items())
            if (name := _executable(pid)) in VITAL]


def nice_all_threads(value: int = 19) -> None:
    """This process's every thread at nice `value` (Linux keeps a nice value per thread, and
    setpriority on the process reaches only the calling one). Raising it needs no privilege."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < value:
                os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:  # the thread ended meanwhile
            continue


class VitalsWatch:
    """A daemon thread that checks `vitals` every `poll_s` and calls `on_lost(vital)` once, for
    the first one found gone, then stops; `lost()` is that one from then on."""

    def __init__(self, vitals: list[Vital], on_lost: Callable[[Vital], None], poll_s: float = POLL_S) -> None:
        self.vitals, self.on_lost, self.poll_s = vitals, on_lost, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-ray-vitals", daemon=True)

    def start(self) -> VitalsWatch:
        if self.vitals:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            gone = [v for v in self.vitals if not alive({v.pid: v.started})]
            if gone:
                global _lost
                _lost = gone[0]
                try:
                    self.on_lost(gone[0])
                except Exception:  # noqa: BLE001 - a thread's error would end it unseen
                    log.exception("acting on the loss of %s", gone[0].describe())
                return
