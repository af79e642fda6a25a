"""CPU time per process group and per thread, from /proc: what bench/serving_profile.py and
bench/idle_cost.py count (Linux only; no sampling, so it costs the machine nothing it measures)."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path
from typing import Any

# A process's group: the first of these found in its command line.
GROUPS = ("DecodeService", "PrefillService", "ColocatedService", "EngineService", "ServeReplica", "ProxyActor",
          "HAProxyManager", "haproxy", "pdserve bench", "pdserve serve", "raylet", "gcs_server", "ServeController",
          "DashboardAgent", "RuntimeEnvAgent", "dashboard", "log_monitor", "monitor")
HZ = os.sysconf("SC_CLK_TCK")


def cpu_snapshot() -> tuple[dict[str, tuple[str, float]], float, float]:
    """{pid: (command line, CPU seconds)}, and the machine's total and idle CPU seconds."""
    procs: dict[str, tuple[str, float]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        procs[pid] = (cmd, (int(fields[11]) + int(fields[12])) / HZ)  # utime + stime
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return procs, sum(cpu) / HZ, (cpu[3] + cpu[4]) / HZ


# Processes whose threads get their own table: where each thread's wall time went.
THREAD_GROUPS = ("DecodeService", "PrefillService", "ColocatedService", "EngineService", "ServeReplica")


def thread_snapshot(groups: tuple[str, ...] = THREAD_GROUPS) -> dict[tuple[str, str], tuple[str, str, int, int]]:
    """{(pid, tid): (group, thread name, ns on a CPU, ns runnable but waiting for one)} from
    /proc/<pid>/task/<tid>/schedstat, for the processes of `groups`."""
    out: dict[tuple[str, str], tuple[str, str, int, int]] = {}
    for pid, (cmd, _) in cpu_snapshot()[0].items():
        group = group_of(cmd)
        if group not in groups:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                on_cpu, waiting, _ = (int(x) for x in Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
            except (OSError, ValueError):
                continue
            out[(pid, tid)] = (group, name, on_cpu, waiting)
    return out


def thread_table(before: dict[tuple[str, str], tuple[str, str, int, int]],
                 after: dict[tuple[str, str], tuple[str, str, int, int]], wall: float) -> list[dict[str, Any]]:
    """Per thread that ran >= 1% of the window: % of the wall time on a CPU, waiting in the run
    queue (wanted a core, none free) and off both (sleeping, blocked: a lock, the GIL, I/O)."""
    rows = []
    for key, (group, name, on1, wait1) in after.items():
        _, _, on0, wait0 = before.get(key, (group, name, 0, 0))
        on, wait = (on1 - on0) / 1e9 / wall * 100, (wait1 - wait0) / 1e9 / wall * 100
        if on >= 1.0:
            rows.append({"group": group, "pid": key[0], "thread": name, "on_cpu_pct": round(on, 1),
                         "runqueue_pct": round(wait, 1), "off_pct": round(max(0.0, 100 - on - wait), 1)})
    return sorted(rows, key=lambda r: (r["group"], -r["on_cpu_pct"]))


def group_of(cmd: str) -> str:
    return next((g for g in GROUPS if g in cmd), "other")


def cpu_table(before: Any, after: Any, wall: float) -> dict[str, float]:
    """Each group's CPU over the window, in % of one core; "machine" = busy % of all cores."""
    (p0, total0, idle0), (p1, total1, idle1) = before, after
    share: collections.Counter[str] = collections.Counter()
    for pid, (cmd, t) in p1.items():
        # By pid alone: Ray retitles its workers as they run tasks (the command line changes).
        group = group_of(cmd if pid not in p0 else p0[pid][0] + " " + cmd)
        share[group] += (t - p0[pid][1] if pid in p0 else t) / wall * 100
        if group == "other" and t - p0.get(pid, ("", 0.0))[1] > 0.05 * wall:
            print(f"[profile] other: {cmd[:100]}", file=sys.stderr)
    out: dict[str, float] = {g: round(v, 1) for g, v in share.most_common() if v >= 0.5}
    out["machine"] = round(((total1 - total0) - (idle1 - idle0)) / wall * 100, 1)
    return out


def pids_of(group: str) -> list[str]:
    """The processes of `group`; not this script, whose own command line may name the group."""
    me = str(os.getpid())
    return [pid for pid, (cmd, _) in cpu_snapshot()[0].items() if group_of(cmd) == group and pid != me]
