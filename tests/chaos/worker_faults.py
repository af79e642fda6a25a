"""The chaos scenarios that strike a worker: killed ((a), (b), (f)), stopped ((d), (j), (n)),
its engine thread crashed ((e)) or one request's row failing ((k))."""

from __future__ import annotations

import signal
import time

from chaos.base import AT_CHUNKS, decodes, excuse_errors_before_recovery, load_for, long_load, prefills
from chaos.harness import Check, Fault, Harness, ScenarioResult
from chaos.load import Load, Outcome, Result
from chaos.procs import alive
from chaos.ray_view import pid_of
from pdserve.cluster.reports import DrainState
from pdserve.workers.fault_seam import WorkerFault

# --- (a) a decode worker killed mid-stream --------------------------------------------


def decode_killed(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        return h.kill_busiest(decodes(h))

    return h.run_fault("a", "decode worker SIGKILL mid-stream", fault, load_for(h), AT_CHUNKS, restarted=True,
                       migrate=True)


def only_decode_killed(h: Harness) -> ScenarioResult:
    """(a, 1P+1D) the only decode worker killed: no survivor; its requests and those sent
    before it is back end with one clean error each (never a drop or a hang)."""
    def fault(_: Load) -> Fault:
        return h.kill_worker(decodes(h)[0])

    return h.run_fault("a1", "only decode worker SIGKILL (1P+1D)", fault, load_for(h), AT_CHUNKS, restarted=True,
                       excuse=excuse_errors_before_recovery)


# --- (b) the prefill worker killed mid-prefill and mid-transfer ------------------------


def _seen_at_the_kill(moment: str, seen: list[bool]) -> Check:
    """(b)'s check: the kill came at its `moment` (`seen`, once the fault has run); a kill at
    any other time, after the wait for the moment ran out, is another scenario's."""
    def check(res: ScenarioResult, _b: dict[str, DrainState | None], _a: dict[str, DrainState | None]) -> None:
        if not all(seen):
            res.failures.append(f"not killed {moment}: the moment was not seen within 10 s")

    return check


def prefill_killed_mid_prefill(h: Harness) -> ScenarioResult:
    """Long prompts; SIGKILL the prefill worker the first time it reports a request (it
    has a prompt in its engine, chunks computed and their KV leaving as they complete)."""
    moment: list[bool] = []

    def fault(_: Load) -> Fault:
        seen = h.wait_for(prefills(h), lambda s: s.jobs > 0 and s.engine_requests > 0, timeout_s=10.0)
        moment.append(seen is not None)
        f = h.kill_worker(seen[0], state=seen[1]) if seen else h.kill_worker(prefills(h)[0])
        f.note += "" if seen else " (no prefill seen in flight within 10 s: killed anyway)"
        return f

    return h.run_fault("b1", "prefill worker SIGKILL mid-prefill", fault, long_load(h, "b1"), 20,
                       restarted=True, check=_seen_at_the_kill("mid-prefill", moment))


def prefill_killed_mid_transfer(h: Harness) -> ScenarioResult:
    """Long prompts; SIGKILL the prefill worker when a decode worker holds a KV
    registration (blocks reserved, the KV on its way into them)."""
    moment: list[bool] = []

    def fault(_: Load) -> Fault:
        seen = h.wait_for(decodes(h), lambda s: s.kv_registrations > 0, timeout_s=10.0)
        moment.append(seen is not None)
        f = h.kill_worker(prefills(h)[0])
        f.note += f"; {seen[0]} awaited KV for {seen[1].kv_registrations}" if seen else \
            " (no KV registration seen within 10 s: killed anyway)"
        return f

    return h.run_fault("b2", "prefill worker SIGKILL mid-transfer", fault, long_load(h, "b2"), 20,
                       restarted=True, check=_seen_at_the_kill("mid-transfer", moment))


# --- (d) a decode worker stopped for 5 s, then continued --------------------------------

STOP_S = 5.0  # under the gateway's stall timeout (--stall-timeout, 10 s): a pause, not a hang


def decode_stopped(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        f = h.kill_busiest(decodes(h), signal.SIGSTOP, f"SIGSTOP {STOP_S:g} s, SIGCONT")
        try:
            time.sleep(STOP_S)
        finally:
            assert f.pid is not None
            h.server.send(f.pid, signal.SIGCONT)
        f.ended = time.monotonic()
        return f

    def kept(res: ScenarioResult, before: dict[str, DrainState | None], after: dict[str, DrainState | None]) -> None:
        target = res.fault.target if res.fault is not None else ""
        b, a = before.get(target), after.get(target)
        if b is not None and a is not None and a.incarnation != b.incarnation:
            res.failures.append(f"{target} was restarted: a pause under the stall timeout must not be")

    return h.run_fault("d", f"decode worker SIGSTOP {STOP_S:g} s + SIGCONT", fault, load_for(h), AT_CHUNKS,
                       restarted=False, check=kept)


# --- (j) a decode worker stopped for 60 s: a hang ------------------------------------------

HANG_S = 60.0
TOKEN_WAIT_BAR_S = 15.0  # issue 46: no stream waits longer than this for a token


def decode_hung(h: Harness) -> ScenarioResult:
    """SIGSTOP the busiest decode worker for 60 s (SIGCONT then, if its process is still
    there). Past the stall timeout (10 s) the gateway gives it up: its streams move to
    the other decode worker and end with the offline text, none waiting more than 15 s
    for a token; Ray restarts it (`ray.kill` ends even a stopped process, so the fault
    ends when its process is gone), and it is back in the pool."""
    return _hung(h, "j", "decode worker SIGSTOP 60 s (hang)", decodes(h))


def colocated_hung(h: Harness) -> ScenarioResult:
    """(j) on a colocated cluster of two workers (cluster/colocated_watch.py)."""
    return _hung(h, "n", "colocated worker SIGSTOP 60 s (hang)", h.server.opts.worker_names())


def _hung(h: Harness, key: str, title: str, names: list[str]) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        f = h.kill_busiest(names, signal.SIGSTOP, f"SIGSTOP (up to {HANG_S:g} s)")
        assert f.pid is not None
        while alive(f.pid) and time.monotonic() < f.started + HANG_S:
            time.sleep(0.1)
        if alive(f.pid):
            h.server.send(f.pid, signal.SIGCONT)
            f.note += f"; SIGCONT after {HANG_S:g} s"
        else:
            f.note += f"; its process was gone {time.monotonic() - f.started:.1f} s after the stop"
        f.ended = time.monotonic()
        return f

    def waits(res: ScenarioResult, before: dict[str, DrainState | None], after: dict[str, DrainState | None]) -> None:
        res.notes.append(f"the longest any request waited for a token: {res.max_gap_s:.1f} s")
        if res.max_gap_s > TOKEN_WAIT_BAR_S:
            res.failures.append(f"a request waited {res.max_gap_s:.1f} s for a token (bar {TOKEN_WAIT_BAR_S:g} s)")
        target = res.fault.target if res.fault is not None else ""
        b, a = before.get(target), after.get(target)
        if a is not None and b is not None:
            res.notes.append(f"{target} back in the pool " + ("from a new process (restarted)"
                                                              if a.incarnation != b.incarnation else "(continued)"))

    return h.run_fault(key, title, fault, load_for(h), AT_CHUNKS, check=waits, migrate=True)


# --- (e) an engine-thread crash ------------------------------------------------------------


def engine_crash(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        seen = h.wait_for(decodes(h), lambda s: s.jobs >= 2, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(decodes(h))
        t = time.monotonic()
        h.view.call(name, "inject_fault", WorkerFault.ENGINE_CRASH.value)
        jobs = state.jobs if state else None
        return Fault("inject_fault(engine_crash)", name, pid_of(state), t, t, f"{jobs} in flight on it", jobs)

    return h.run_fault("e", "decode engine-thread crash (injected)", fault, load_for(h), AT_CHUNKS, restarted=True,
                       migrate=True)


# --- (k) one request's row poisoned on a decode worker ---------------------------------------


def row_poisoned(h: Harness, rows: int = 1) -> ScenarioResult:
    """A decode worker's engine is made to fail `rows` running requests' rows in every step
    (`inject_fault(poison_row)`: what a top_k past int64 did to a worker at 9a2ece5).
    Those requests alone end, with a clean error (500, in their streams), and are not moved
    to another worker (the poison-pill rule); every other request is whole, and no worker
    restarts (with two, the engine checks itself before it blames the rows)."""
    def fault(_: Load) -> Fault:
        seen = h.wait_for(decodes(h), lambda s: s.jobs >= 2 * rows, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(decodes(h))
        t = time.monotonic()
        for _row in range(rows):
            h.view.call(name, "inject_fault", WorkerFault.POISON_ROW.value)
        jobs = state.jobs if state else None
        return Fault("inject_fault(poison_row)", name, pid_of(state), t, t, f"{jobs} in flight on it", jobs)

    def the_poisoned(r: Result, _fault: Fault, _recovered_at: float | None) -> bool:
        return r.outcome is Outcome.ERROR and r.status == 500

    def alone(res: ScenarioResult, before: dict[str, DrainState | None], after: dict[str, DrainState | None]) -> None:
        faulted = res.counters.get("pdserve:requests_faulted", 0)
        res.notes.append(f"requests failed alone: {faulted:g}; clean errors: {res.errors}")
        if faulted != rows or res.errors != rows:
            res.failures.append(f"{faulted:g} requests failed alone and {res.errors} errors: want {rows} and {rows}")
        if res.counters.get("pdserve:request_migrations"):
            res.failures.append("a request moved: the poisoned one must not, and nothing else had to")
        if any(a is not None and (b := before.get(n)) is not None and a.incarnation != b.incarnation
               for n, a in after.items()):
            res.failures.append("a worker restarted: one bad row must not take its worker down")

    key, title = ("k", "one request's row fails on a decode worker (injected)") if rows == 1 else (
        f"k{rows}", f"{rows} requests' rows fail on one decode worker (injected)")
    return h.run_fault(key, title, fault, load_for(h), AT_CHUNKS, excuse=the_poisoned, check=alone)


def two_rows_poisoned(h: Harness) -> ScenarioResult:
    return row_poisoned(h, rows=2)


# --- (f) the only prefill worker killed ------------------------------------------------------


def only_prefill_killed(h: Harness) -> ScenarioResult:
    """No prefill worker for a while: handoffs in flight recompute on their decode worker,
    new requests are prefilled there (the router's fallback); none may fail."""
    def fault(_: Load) -> Fault:
        seen = h.wait_for(prefills(h), lambda s: s.jobs > 0, timeout_s=5.0)
        return h.kill_worker(seen[0], state=seen[1]) if seen else h.kill_worker(prefills(h)[0])

    return h.run_fault("f", "only prefill worker SIGKILL", fault, load_for(h), AT_CHUNKS, restarted=True)
