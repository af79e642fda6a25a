"""The chaos scenarios that stop `pdserve serve` itself: killed or signalled and started
again ((i1), (i2)), or stopping on its own when local Ray loses its GCS ((o)) or raylet ((p))."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

from chaos.base import AFTER, AT_CHUNKS, SELF_STOP_S, load_for
from chaos.harness import (
    DRAIN_TIMEOUT_S,
    Excuse,
    Fault,
    Harness,
    ScenarioResult,
    before_recovery,
    recovery_budget,
)
from chaos.leaks import leaks
from chaos.load import Load, Outcome, Result
from chaos.procs import cmdline, session_members
from chaos.ray_view import RayView

# --- (i) `pdserve serve` itself killed, then started again -----------------------------------------


def _before_a_restart(h: Harness, key: str, title: str) -> tuple[ScenarioResult, Load]:
    """A scenario whose server stops (and is started again): its result, budget and load, once
    the server is ready, and this process off its Ray (a driver on a Ray whose GCS dies may be
    ended by Ray: leave first)."""
    res = ScenarioResult(key, title)
    h.wait_ready()
    res.budget_s = recovery_budget(h.server.startup_s or 60.0)
    load = load_for(h)
    h.view.close()
    return res, load


def _restart(h: Harness, res: ScenarioResult, faulted: float) -> None:
    """Start the killed or stopped server again on its ports (as a supervisor would) and wait
    until it is healthy; its recovery is timed from `faulted`, and its start's pdserve lines noted."""
    server = h.server
    left = server.pids()
    log_start = server.log_path.stat().st_size
    server.restart()
    res.notes.append(f"restarted {time.monotonic() - faulted:.1f} s after the fault; the old run's processes alive "
                     f"then: {_describe(left)}")
    try:
        server.wait_healthy(max(120.0, 3 * (res.budget_s or 60.0)))
        res.recovery_s = time.monotonic() - faulted
    except RuntimeError as e:
        res.failures.append(f"not healthy after the restart: {str(e).splitlines()[0]}")
        res.notes.append(server.log_tail(15))
    with open(server.log_path, errors="replace") as f:
        f.seek(log_start)
        res.notes += [line.strip() for line in f if line.startswith("pdserve:")]


def _strike_mid_load(h: Harness, load: Load, strike: Callable[[], None]) -> list[Result]:
    """Run `load` against the server and call `strike` (in a thread) once it has streamed AT_CHUNKS."""
    async def scenario() -> list[Result]:
        reached = asyncio.Event()
        load.on_chunk = lambda n: reached.set() if n >= AT_CHUNKS else None

        async def striker_() -> None:
            await reached.wait()
            await asyncio.to_thread(strike)

        striker = asyncio.create_task(striker_())
        results = await load.run(h.server.url)
        if not reached.is_set():  # the fault's moment never comes: awaiting the striker would wait forever
            striker.cancel()
            raise RuntimeError(f"the load ended after {load.chunks} chunks, before the fault's {AT_CHUNKS}")
        await striker
        return results

    return asyncio.run(scenario())


def _judge_restarted(h: Harness, res: ScenarioResult, results: list[Result], fault: Fault, excuse: Excuse,
                     t0: float) -> ScenarioResult:
    """Count `results` against `fault`, then hold the new run to the requests after recovery."""
    res.fault = fault
    recovered_at = fault.ended + res.recovery_s if res.recovery_s is not None else None
    h._count(res, results, fault, recovered_at, excuse)
    if res.recovery_s is not None:
        h.view = RayView(h.server.ray_address())
        # The new run's workers never saw the load: their baseline of tasks and threads (against
        # an empty one, none could ever count) is taken once they are ready and warmed up, as at
        # Harness.start; the drain then holds them to it after the requests below.
        h.wait_ready()
        h.warm_up()
        before = h.baseline()
        h.after_recovery(res, AFTER)
        res.leaks = leaks(before, h.drain(before, timeout_s=DRAIN_TIMEOUT_S))
    res.judge()
    res.elapsed_s = time.monotonic() - t0
    return res


def server_killed(h: Harness, how: str = "SIGKILL") -> ScenarioResult:
    """Mid-load, `pdserve serve` is killed (SIGKILL to its process, or SIGTERM to its
    process group), then started again on the same ports as soon as its process is
    gone. Its streams are cut, and requests fail until the new one serves (excused);
    the new one must be healthy within the first start's time + 10 s of the fault,
    with whatever the old one left (Ray's agents, an orphaned HAProxy holding the
    port) cleared or reported, and serve every request after."""
    key = "i1" if how == "SIGKILL" else "i2"
    title = "pdserve serve SIGKILL, restarted" if how == "SIGKILL" else "pdserve serve SIGTERM to its group, restarted"
    t0 = time.monotonic()
    res, load = _before_a_restart(h, key, title)
    server = h.server
    faults: list[Fault] = []

    def kill_and_restart() -> None:
        t = time.monotonic()
        old = server.sid
        if how == "SIGKILL":
            server.kill_main(signal.SIGKILL)
        else:
            os.killpg(old, signal.SIGTERM)  # the group of the process the harness started
        faults.append(Fault(how, "pdserve serve", old, t, t))
        assert server.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(30)
        _restart(h, res, t)
        res.notes.append(f"the old run's processes still alive once the new one was healthy: "
                         f"{_describe(session_members(old))}")

    results = _strike_mid_load(h, load, kill_and_restart)
    return _judge_restarted(h, res, results, faults[0], before_recovery, t0)


def control_plane_lost(h: Harness, which: str) -> ScenarioResult:
    """Mid-load, local Ray's GCS or raylet (`which`: its executable's name) is SIGKILLed.
    Nothing replaces either, so `pdserve serve` must see it (cluster/ray_vitals.py), drain and
    exit 1 by itself, well before Ray's own end of its processes 60 s later, and then serves
    again once started again (as a supervisor would). Every stream in flight at the fault must
    end with [DONE] or an error event (a drop is a failure here, unlike a killed server's), and
    requests until the new start serves get clean errors or a refused connection (excused)."""
    key, title = ("o", "local Ray's GCS SIGKILL") if which == "gcs_server" else ("p", "local Ray's raylet SIGKILL")
    t0 = time.monotonic()
    res, load = _before_a_restart(h, key, title)
    server = h.server
    faults: list[Fault] = []
    exited: list[float] = []

    def kill_and_restart() -> None:
        victims = [pid for pid in server.pids() if os.path.basename(cmdline(pid).split(" ", 1)[0]) == which]
        if len(victims) != 1:
            res.failures.append(f"found {len(victims)} {which} process(es) among the server's: {victims}")
            return
        t = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        faults.append(Fault("SIGKILL", which, victims[0], t, t))
        assert server.proc is not None
        try:
            code = server.proc.wait(SELF_STOP_S)
            exited.append(time.monotonic())
            res.notes.append(f"pdserve serve exited with {code} {exited[0] - t:.1f} s after the fault")
            if code != 1:
                res.failures.append(f"pdserve serve exited with {code}, not 1")
        except subprocess.TimeoutExpired:
            res.failures.append(f"pdserve serve still running {SELF_STOP_S:g} s after the fault")
        _restart(h, res, t)

    results = _strike_mid_load(h, load, kill_and_restart)
    if not faults:
        res.judge()
        return res
    fault = faults[0]
    down_at = exited[0] if exited else None

    def excused(r: Result, f: Fault, at: float | None) -> bool:
        # A clean error until the new start serves; a refused connection only once the old one is gone.
        if r.outcome is Outcome.ERROR:
            return before_recovery(r, f, at)
        return (r.outcome is Outcome.DROPPED and down_at is not None and r.started >= down_at - 0.5
                and before_recovery(r, f, at))

    cut = [r for r in results if r.outcome is Outcome.DROPPED and r.started < fault.started]
    if cut:
        res.failures.append(f"{len(cut)} stream(s) in flight at the fault cut with no [DONE] or error event")
    return _judge_restarted(h, res, results, fault, excused, t0)


def _describe(pids: list[int]) -> str:
    if not pids:
        return "none"
    return ", ".join(f"{p} {cmdline(p).split()[0] if cmdline(p) else '?'}" for p in pids)
