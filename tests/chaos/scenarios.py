"""The chaos scenarios of issue 13 (a)-(i), issue 46 (j)-(l) and issue 47 (m), each a
function of a running `Harness` (harness.py), and the matrix they make (bench/chaos.py
prints it; test_chaos.py runs the CI subset).

Every scenario runs streaming greedy load over fresh probe prompts, strikes a
process the harness started (by pid) once the load has streamed `AT_CHUNKS`
chunks, and is judged the same way (`ScenarioResult.judge`): 0 wrong, 0 hung,
0 lost while a survivor could serve, nothing held by any worker after the drain
(KV blocks, KV registrations, requests; tasks and threads back to each worker's
baseline), the pool back to size (a killed worker answering from a new process)
and /health 200 "ok" within 1.5 x model load + 10 s of the fault
(`recovery_budget`), and every request after recovery ok.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chaos.harness import (
    COUNTERS,
    DRAIN_TIMEOUT_S,
    Check,
    Excuse,
    Fault,
    Harness,
    RayView,
    ScenarioResult,
    ServerOptions,
    before_recovery,
    pid_of,
    recovery_budget,
)
from chaos.leaks import leaks
from chaos.load import ENDPOINTS, HealthSample, HealthWatch, Load, Outcome, Probe, Result, make_probes
from chaos.procs import alive, can_cut_links, cmdline, cut_links, links, loopback_ports, session_members
from pdserve.cluster.reports import DrainState
from pdserve.workers.fault_seam import WorkerFault

REQUESTS = 48  # per scenario's load
CONCURRENCY = 8
MAX_TOKENS = 128  # each probe's: streams long enough to be cut mid-way (~1 s at 8 concurrent)
AT_CHUNKS = 500  # the fault strikes once the load has streamed this many chunks (~1/10 of it)
AFTER = 8  # requests after recovery, all at once (both decode workers get some): all must be ok
# (o, p): by when `pdserve serve` has drained and exited on its own after its GCS's or raylet's loss
# (the drain's 10 s, the sweep's 3 s, on 2 cores); Ray itself ends everything at 60 s.
SELF_STOP_S = 30.0


def excuse_errors_before_recovery(r: Result, fault: Fault, recovered_at: float | None) -> bool:
    """The only worker of a role was down: a clean error (never a drop or a hang) is
    what a request in flight then, or sent before recovery, should get."""
    return r.outcome is Outcome.ERROR and before_recovery(r, fault, recovered_at)


def _load(h: Harness, requests: int = REQUESTS, concurrency: int = CONCURRENCY, **kw: object) -> Load:
    return Load(h.probes, requests=requests, concurrency=concurrency, offset=h.take(requests), **kw)  # type: ignore[arg-type]


def _decodes(h: Harness) -> list[str]:
    return h.server.opts.decode_names()


def _prefills(h: Harness) -> list[str]:
    return h.server.opts.prefill_names()


LONG_USERS = ("b1", "b2", "g1")  # the scenarios on long prompts: each has its own REQUESTS of them


def _long_load(h: Harness, key: str) -> Load:
    """Prompts of 600-1500 tokens (fresh ones for each scenario): their prefill and KV
    transfer take long enough to be struck."""
    probes = h.probe_set("long", REQUESTS * len(LONG_USERS), 32, (600, 1500))
    return Load(probes, requests=REQUESTS, concurrency=CONCURRENCY, offset=REQUESTS * LONG_USERS.index(key))


# --- (a) a decode worker killed mid-stream --------------------------------------------


def decode_killed(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        return h.kill_busiest(_decodes(h))

    return h.run_fault("a", "decode worker SIGKILL mid-stream", fault, _load(h), AT_CHUNKS, restarted=True,
                       migrate=True)


def only_decode_killed(h: Harness) -> ScenarioResult:
    """(a, 1P+1D) the only decode worker killed: no survivor; its requests and those sent
    before it is back end with one clean error each (never a drop or a hang)."""
    def fault(_: Load) -> Fault:
        return h.kill_worker(_decodes(h)[0])

    return h.run_fault("a1", "only decode worker SIGKILL (1P+1D)", fault, _load(h), AT_CHUNKS, restarted=True,
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
        seen = h.wait_for(_prefills(h), lambda s: s.jobs > 0 and s.engine_requests > 0, timeout_s=10.0)
        moment.append(seen is not None)
        f = h.kill_worker(seen[0], state=seen[1]) if seen else h.kill_worker(_prefills(h)[0])
        f.note += "" if seen else " (no prefill seen in flight within 10 s: killed anyway)"
        return f

    return h.run_fault("b1", "prefill worker SIGKILL mid-prefill", fault, _long_load(h, "b1"), 20,
                       restarted=True, check=_seen_at_the_kill("mid-prefill", moment))


def prefill_killed_mid_transfer(h: Harness) -> ScenarioResult:
    """Long prompts; SIGKILL the prefill worker when a decode worker holds a KV
    registration (blocks reserved, the KV on its way into them)."""
    moment: list[bool] = []

    def fault(_: Load) -> Fault:
        seen = h.wait_for(_decodes(h), lambda s: s.kv_registrations > 0, timeout_s=10.0)
        moment.append(seen is not None)
        f = h.kill_worker(_prefills(h)[0])
        f.note += f"; {seen[0]} awaited KV for {seen[1].kv_registrations}" if seen else \
            " (no KV registration seen within 10 s: killed anyway)"
        return f

    return h.run_fault("b2", "prefill worker SIGKILL mid-transfer", fault, _long_load(h, "b2"), 20,
                       restarted=True, check=_seen_at_the_kill("mid-transfer", moment))


# --- (c) the gateway replica killed -----------------------------------------------------

ORPHANS = 12  # long streams cut with the gateway: still running on the workers GATEWAY_GONE_S later
ORPHAN_TOKENS = 1800


def gateway_killed(h: Harness) -> ScenarioResult:
    """SIGKILL the gateway replica (Ray Serve starts another). Its streams are cut (the
    client sees the connection drop: counted as dropped, excused); requests sent before
    the new replica serves are excused too. The workers must abort the cut requests
    themselves (their gateway is gone: orphans_aborted) and hold nothing after."""
    orphan = Probe(tuple(range(100, 160)), ORPHAN_TOKENS, "")

    def fault(_: Load) -> Fault:
        pid = h.server.gateway_pid()
        if pid is None:
            raise RuntimeError("no gateway replica process")
        t = time.monotonic()
        h.server.send(pid, signal.SIGKILL)
        return Fault("SIGKILL", "gateway replica", pid, t, t)

    def orphans(res: ScenarioResult, before: dict[str, DrainState | None],
                after: dict[str, DrainState | None]) -> None:
        aborted = sum(a.orphans_aborted - b.orphans_aborted for n, a in after.items()
                      if a is not None and (b := before.get(n)) is not None and a.incarnation == b.incarnation)
        res.notes.append(f"{ORPHANS} long streams cut with the gateway; the workers counted {aborted} of their "
                         "requests as orphans (orphans_aborted); the rest ended when their token stream's send "
                         "queue filled (the drain check: nothing left)")

    load = _load(h, long_streams=[dataclasses.replace(orphan, prompt=(100 + i, *orphan.prompt))
                                  for i in range(ORPHANS)])
    return h.run_fault("c", "gateway replica SIGKILL", fault, load, AT_CHUNKS, gateway_restart=True,
                       excuse=before_recovery, check=orphans)


# --- (m) one of two gateway replicas killed ------------------------------------------------

REPLICA_CONCURRENCY = 16  # streams at once: several on each replica when one dies
# Long streams beside the load (with their oracle), surely mid-way on the server at the kill: the
# dead replica's are cut, and the workers must end them; the survivor's must complete exactly.
REPLICA_LONG = 6
REPLICA_LONG_TOKENS = 1000  # ~15 s at this machine's pace: past the kill, within --request-timeout
HEALTH_EVERY_S = 0.1
REPLICA_BUDGET_S = 30.0  # issue 47: the killed replica serves again "within seconds"


@dataclass
class _ReplicaKill:
    """(m): which replica the fault killed (its rank, as responses name it) and when."""

    rank: str | None = None
    at: float = 0.0


def replica_killed(h: Harness) -> ScenarioResult:
    """Two gateway replicas (`--gateway-replicas 2`, HAProxy spreading connections over them);
    SIGKILL the one with the most streams in flight (by pid; its rank asked in it). Every
    stream is attributed to the replica that answered it (x-pdserve-replica). The dead
    replica's streams are cut (dropped, excused); every other stream must complete exactly:
    the survivor's, and those sent after the kill (HAProxy sends one the dead replica refused,
    or closed unanswered, to the live one: cluster/serve_app.py's HAPROXY_RETRY_ENV). /health, polled every 0.1 s on a
    fresh connection from before the load until the checks, must never be non-200. Long streams
    beside the load are surely mid-way on the server at the kill (the client's clock lags the
    server's on a busy machine: a short stream it still reads may be done there): the dead
    replica's are cut, and the workers must end them and hold nothing after; the survivor's
    must complete exactly. Serve starts another replica with the dead one's rank:
    recovery is when it answers /health (within REPLICA_BUDGET_S), and it must serve some of
    the requests after recovery."""
    watch = HealthWatch(h.server.url, HEALTH_EVERY_S, max_s=600.0)
    kill = _ReplicaKill()
    longs = h.probe_set("replica-long", REPLICA_LONG, REPLICA_LONG_TOKENS, (40, 120))
    load = _load(h, concurrency=REPLICA_CONCURRENCY, long_streams=longs, check_long=True)
    ranks = h.view.gateway_ranks()  # asked before the load: the answer takes seconds on a busy machine
    if len(ranks) < 2:
        raise RuntimeError(f"want 2 gateway replicas, found {ranks} (pid: rank)")

    def fault(load: Load) -> Fault:
        on = Counter(list(load.in_flight.values()))
        rank = max(ranks.values(), key=lambda r: (on[str(r)], r))
        pid = next(p for p, r in ranks.items() if r == rank)
        kill.rank, kill.at = str(rank), time.monotonic()
        h.server.send(pid, signal.SIGKILL)
        in_flight = ", ".join(f"{on[str(r)]} on replica {r}" for r in sorted(ranks.values()))
        return Fault("SIGKILL", f"gateway replica {rank}", pid, kill.at, kill.at,
                     f"streams in flight (long ones too): {in_flight}", on[str(rank)])

    def cut_with_it(r: Result, _fault: Fault, _recovered_at: float | None) -> bool:
        """A request sent before the kill that the killed replica was answering (or that no
        replica had answered yet: the live one would have by the end)."""
        return r.outcome in (Outcome.DROPPED, Outcome.ERROR) and r.replica in (kill.rank, None) and r.started <= kill.at

    def serves_again() -> bool:
        """The dead replica's rank (a new process) answered /health after the kill."""
        return kill.rank is not None and any(x.at > kill.at and x.replica == kill.rank for x in list(watch.samples))

    def only_its_own(res: ScenarioResult, before: dict[str, DrainState | None],
                     after: dict[str, DrainState | None]) -> None:
        samples = watch.stop()
        dead = kill.rank or "?"
        _streams_by_replica(res, h.load_results, kill.at, dead)
        _health_through(res, samples, kill.at, dead)
        served = Counter(r.replica for r in h.after_results if r.outcome is Outcome.OK)
        res.notes.append(f"after recovery, requests served by replica: {dict(sorted(served.items(), key=str))}")
        if not served[dead]:
            res.failures.append(f"the restarted replica {dead} served none of the {len(h.after_results)} "
                                "requests after recovery")
        aborted = sum(a.orphans_aborted - b.orphans_aborted for n, a in after.items()
                      if a is not None and (b := before.get(n)) is not None and a.incarnation == b.incarnation)
        res.notes.append(f"the workers counted {aborted} requests as orphans (orphans_aborted); the drain "
                         "check: nothing left on any worker")

    watch.start()  # from before the load: a first answer can take seconds on a busy machine
    try:
        return h.run_fault("m", "one of two gateway replicas SIGKILL", fault, load, AT_CHUNKS, gateway_restart=True,
                           excuse=cut_with_it, budget_s=REPLICA_BUDGET_S, check=only_its_own, ready=serves_again)
    finally:
        watch.stop()


def _streams_by_replica(res: ScenarioResult, results: list[Result], kill: float, dead: str) -> None:
    """Notes the streams the kill cut and the survivor's in flight then; fails the scenario
    when it cut none, or when none of the survivor's long streams (surely mid-way on the server)
    was in flight: the kill then proved nothing."""
    cut = [r for r in results if r.replica == dead and r.outcome is Outcome.DROPPED and r.started <= kill]
    alive = [r for r in results if r.replica not in (dead, None) and r.started <= kill <= r.ended]
    long_alive = [r for r in alive if r.index < 0]
    res.notes.append(f"the kill cut {len(cut)} streams of replica {dead} ({sum(r.index < 0 for r in cut)} long "
                     f"ones); the survivor's in flight then: {len(alive)} ({len(long_alive)} long ones), "
                     f"{sum(r.outcome is Outcome.OK for r in alive)} of them ok")
    if not cut or not long_alive:
        res.failures.append(f"the kill cut {len(cut)} streams of replica {dead}, with {len(long_alive)} long ones "
                            "of the survivor in flight: want some of each (else the kill proved nothing)")


def _health_through(res: ScenarioResult, samples: list[HealthSample], kill: float, dead: str) -> None:
    """/health through the kill: every answer 200; when the dead replica's rank answered again."""
    bad = [x for x in samples if x.status != 200]
    back = next((x.at + x.took_s - kill for x in samples if x.at > kill and x.replica == dead), None)
    slowest = max((x.took_s for x in samples), default=0.0)
    res.notes.append(f"/health polled {len(samples)} times from {samples[0].at - kill:+.2f} s to "
                     f"{samples[-1].at - kill:+.1f} s of the kill, slowest {slowest:.2f} s; {len(bad)} not 200"
                     if samples else "/health: no sample")
    for x in bad[:5]:
        res.notes.append(f"/health sent at {x.at - kill:+.2f} s of the kill, {x.took_s:.2f} s: {x.status} {x.detail}")
    if bad:
        res.failures.append(f"/health not 200 {len(bad)} times (first at {bad[0].at - kill:+.2f} s of the kill)")
    if back is None:
        res.failures.append(f"replica {dead} never answered /health again")
    else:
        res.notes.append(f"replica {dead} (a new process) answered /health {back:.1f} s after the kill")


# --- (l) the ingress (HAProxy) killed ----------------------------------------------------

INGRESS_BUDGET_S = 10.0  # issue 46: /health 200 again within 10 s of HAProxy's SIGKILL


def ingress_killed(h: Harness) -> ScenarioResult:
    """SIGKILL every HAProxy process of the server (by pid); `pdserve serve` starts
    another (cluster/haproxy_guard.py; Ray Serve's controller is the fallback). Every stream
    through it is cut (dropped, excused, as are requests sent before /health answers
    again); the gateway sees each client go and aborts its request, so the workers hold
    nothing after (the drain check). Recovery within 10 s, not the model-load budget."""
    def fault(_: Load) -> Fault:
        pids = [pid for pid in h.server.pids() if os.path.basename(cmdline(pid).split(" ", 1)[0]) == "haproxy"]
        if not pids:
            raise RuntimeError("no HAProxy process")
        t = time.monotonic()
        for pid in pids:
            h.server.send(pid, signal.SIGKILL)
        return Fault("SIGKILL", "HAProxy ingress", pids[0], t, t, f"{len(pids)} process(es)")

    return h.run_fault("l", "HAProxy ingress SIGKILL", fault, _load(h), AT_CHUNKS, excuse=before_recovery,
                       budget_s=INGRESS_BUDGET_S)


# --- (d) a decode worker stopped for 5 s, then continued --------------------------------

STOP_S = 5.0  # under the gateway's stall timeout (--stall-timeout, 10 s): a pause, not a hang


def decode_stopped(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        f = h.kill_busiest(_decodes(h), signal.SIGSTOP, f"SIGSTOP {STOP_S:g} s, SIGCONT")
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

    return h.run_fault("d", f"decode worker SIGSTOP {STOP_S:g} s + SIGCONT", fault, _load(h), AT_CHUNKS,
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
    return _hung(h, "j", "decode worker SIGSTOP 60 s (hang)", _decodes(h))


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

    return h.run_fault(key, title, fault, _load(h), AT_CHUNKS, check=waits, migrate=True)


# --- (e) an engine-thread crash ------------------------------------------------------------


def engine_crash(h: Harness) -> ScenarioResult:
    def fault(_: Load) -> Fault:
        seen = h.wait_for(_decodes(h), lambda s: s.jobs >= 2, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(_decodes(h))
        t = time.monotonic()
        h.view.call(name, "inject_fault", WorkerFault.ENGINE_CRASH.value)
        jobs = state.jobs if state else None
        return Fault("inject_fault(engine_crash)", name, pid_of(state), t, t, f"{jobs} in flight on it", jobs)

    return h.run_fault("e", "decode engine-thread crash (injected)", fault, _load(h), AT_CHUNKS, restarted=True,
                       migrate=True)


# --- (k) one request's row poisoned on a decode worker ---------------------------------------


def row_poisoned(h: Harness, rows: int = 1) -> ScenarioResult:
    """A decode worker's engine is made to fail `rows` running requests' rows in every step
    (`inject_fault(poison_row)`: what a top_k past int64 did to a worker at 9a2ece5).
    Those requests alone end, with a clean error (500, in their streams), and are not moved
    to another worker (the poison-pill rule); every other request is whole, and no worker
    restarts (with two, the engine checks itself before it blames the rows)."""
    def fault(_: Load) -> Fault:
        seen = h.wait_for(_decodes(h), lambda s: s.jobs >= 2 * rows, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(_decodes(h))
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
    return h.run_fault(key, title, fault, _load(h), AT_CHUNKS, excuse=the_poisoned, check=alone)


def two_rows_poisoned(h: Harness) -> ScenarioResult:
    return row_poisoned(h, rows=2)


# --- (f) the only prefill worker killed ------------------------------------------------------


def only_prefill_killed(h: Harness) -> ScenarioResult:
    """No prefill worker for a while: handoffs in flight recompute on their decode worker,
    new requests are prefilled there (the router's fallback); none may fail."""
    def fault(_: Load) -> Fault:
        seen = h.wait_for(_prefills(h), lambda s: s.jobs > 0, timeout_s=5.0)
        return h.kill_worker(seen[0], state=seen[1]) if seen else h.kill_worker(_prefills(h)[0])

    return h.run_fault("f", "only prefill worker SIGKILL", fault, _load(h), AT_CHUNKS, restarted=True)


# --- (g) a link cut mid-transfer ---------------------------------------------------------------

CUTS = 5


def _cut_some(what: str, cut: list[int]) -> Check:
    """A link-cut scenario's check: `cut` (the fault's count of connections it cut, once it has
    run) must be above 0; with nothing cut, nothing was struck and the load's verdict proves nothing."""
    def check(res: ScenarioResult, _b: dict[str, DrainState | None], _a: dict[str, DrainState | None]) -> None:
        if not sum(cut):
            res.failures.append(f"no {what} connection was cut: the fault struck nothing")

    return check


def kv_link_cut(h: Harness) -> ScenarioResult:
    """Long prompts; each time a decode worker awaits KV, the TCP connections of the
    prefill worker's KV link to it are destroyed under both ends (`ss -K`), up to
    CUTS times: the transfer in flight is lost with its socket, ZeroMQ reconnects, the
    link resyncs; the decode worker's request recomputes (or its KV arrives anyway)."""
    if not can_cut_links():
        return ScenarioResult("g1", "KV link cut mid-transfer", skipped="needs root for ss -K")

    struck: list[int] = []

    def fault(_: Load) -> Fault:
        t, cut, hit = time.monotonic(), 0, 0
        prefill = pid_of(h.view.states(_prefills(h))[_prefills(h)[0]])
        for _try in range(CUTS):
            seen = h.wait_for(_decodes(h), lambda s: s.kv_registrations > 0, timeout_s=3.0, poll_s=0.005)
            if seen is None or prefill is None:
                continue
            decode = pid_of(seen[1])
            assert decode is not None
            conns = links(prefill, decode, loopback_ports(decode))
            n = cut_links(conns)
            cut += n
            hit += bool(n)
            time.sleep(0.3)
        struck.append(cut)
        return Fault("ss -K (KV link)", "prefill -> decode", prefill, t, time.monotonic(),
                     f"{cut} connections cut in {hit} of {CUTS} tries, each with KV awaited")

    return h.run_fault("g1", "KV link cut mid-transfer (ss -K)", fault, _long_load(h, "g1"), 20,
                       check=_cut_some("KV link", struck))


def token_link_cut(h: Harness) -> ScenarioResult:
    """Mid-stream, the decode workers' token-stream connections to the gateway are
    destroyed (`ss -K`) 3 times, 0.5 s apart: batches in the cut sockets are lost; the
    gateway sees the gap in the worker's numbering and moves the request on."""
    if not can_cut_links():
        return ScenarioResult("g2", "token link cut mid-stream", skipped="needs root for ss -K")

    struck: list[int] = []

    def fault(_: Load) -> Fault:
        t, cut = time.monotonic(), 0
        gateway = h.server.gateway_pid()
        states = h.view.states(_decodes(h))
        for _round in range(3):
            for s in states.values():
                decode = pid_of(s)
                if decode is not None and gateway is not None:
                    cut += cut_links(links(decode, gateway))
            time.sleep(0.5)
        struck.append(cut)
        return Fault("ss -K (token link)", "decode -> gateway", gateway, t, time.monotonic(),
                     f"{cut} connections cut")

    return h.run_fault("g2", "token link cut mid-stream (ss -K)", fault, _load(h), AT_CHUNKS,
                       check=_cut_some("token link", struck))


# --- (h) a kill during a burst of client disconnects ---------------------------------------------


def disconnect_burst(h: Harness) -> ScenarioResult:
    """16 streams; at the fault, half of them hang up at once and the busiest decode
    worker is SIGKILLed. The other half must complete exactly; nothing may be left."""
    def fault(load: Load) -> Fault:
        seen = h.wait_for(_decodes(h), lambda s: s.jobs >= 4, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(_decodes(h))
        load.hang_up_now()
        f = h.kill_worker(name, state=state)
        f.what = "disconnect burst + SIGKILL"
        return f

    load = _load(h, requests=REQUESTS, concurrency=16, hang_up_if=lambda i: i % 2 == 0, hang_up=asyncio.Event())

    def closed(res: ScenarioResult, _b: dict[str, DrainState | None], _a: dict[str, DrainState | None]) -> None:
        res.notes.append(f"{res.closed} streams hung up by their clients")
        if res.closed < 4:
            res.failures.append(f"only {res.closed} clients hung up: no burst")

    return h.run_fault("h", "disconnect burst + decode SIGKILL", fault, load, AT_CHUNKS, restarted=True,
                       check=closed, migrate=True)


# --- (i) `pdserve serve` itself killed, then started again -----------------------------------------


def _before_a_restart(h: Harness, key: str, title: str) -> tuple[ScenarioResult, Load]:
    """A scenario whose server stops (and is started again): its result, budget and load, once
    the server is ready, and this process off its Ray (a driver on a Ray whose GCS dies may be
    ended by Ray: leave first)."""
    res = ScenarioResult(key, title)
    h.wait_ready()
    res.budget_s = recovery_budget(h.server.startup_s or 60.0)
    load = _load(h)
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


# --- the matrix -----------------------------------------------------------------------------------

ONE_DECODE = "1p1d"
TWO_DECODE = "1p2d"
TWO_GATEWAYS = "1p2d2g"  # TWO_DECODE's workers behind two gateway replicas
TWO_COLOCATED = "2c"  # `--mode colocated`, two workers
OWN = "own"  # a server of its own (killed)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    server: str  # which harness runs it: TWO_DECODE, TWO_GATEWAYS, ONE_DECODE, TWO_COLOCATED, OWN
    run: Callable[[Harness], ScenarioResult]
    probes: int = REQUESTS + AFTER  # of the harness's main set


SCENARIOS = [
    Scenario("a", "decode worker SIGKILL mid-stream", TWO_DECODE, decode_killed),
    Scenario("a1", "only decode worker SIGKILL (1P+1D)", ONE_DECODE, only_decode_killed),
    Scenario("b1", "prefill worker SIGKILL mid-prefill", TWO_DECODE, prefill_killed_mid_prefill, AFTER),
    Scenario("b2", "prefill worker SIGKILL mid-transfer", TWO_DECODE, prefill_killed_mid_transfer, AFTER),
    Scenario("c", "gateway replica SIGKILL", TWO_DECODE, gateway_killed),
    Scenario("l", "HAProxy ingress SIGKILL", TWO_DECODE, ingress_killed),
    Scenario("m", "one of two gateway replicas SIGKILL", TWO_GATEWAYS, replica_killed),
    Scenario("d", f"decode worker SIGSTOP {STOP_S:g} s + SIGCONT", TWO_DECODE, decode_stopped),
    Scenario("e", "decode engine-thread crash (injected)", TWO_DECODE, engine_crash),
    Scenario("f", "only prefill worker SIGKILL", TWO_DECODE, only_prefill_killed),
    Scenario("g1", "KV link cut mid-transfer (ss -K)", TWO_DECODE, kv_link_cut, AFTER),
    Scenario("g2", "token link cut mid-stream (ss -K)", TWO_DECODE, token_link_cut),
    Scenario("h", "disconnect burst + decode SIGKILL", TWO_DECODE, disconnect_burst),
    Scenario("i1", "pdserve serve SIGKILL, restarted", OWN, lambda h: server_killed(h, "SIGKILL")),
    Scenario("i2", "pdserve serve SIGTERM to its group, restarted", OWN, lambda h: server_killed(h, "SIGTERM")),
    Scenario("j", "decode worker SIGSTOP 60 s (hang)", TWO_DECODE, decode_hung),
    Scenario("o", "local Ray's GCS SIGKILL", OWN, lambda h: control_plane_lost(h, "gcs_server")),
    Scenario("p", "local Ray's raylet SIGKILL", OWN, lambda h: control_plane_lost(h, "raylet")),
    Scenario("k", "one request's row fails on a decode worker (injected)", TWO_DECODE, row_poisoned),
    Scenario("k2", "2 requests' rows fail on one decode worker (injected)", TWO_DECODE, two_rows_poisoned),
    Scenario("n", "colocated worker SIGSTOP 60 s (hang)", TWO_COLOCATED, colocated_hung),
]
BY_KEY = {s.key: s for s in SCENARIOS}

MODEL_SPEC = dict(arch="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
WARM_UP = 16


def server_options(model: str, which: str) -> ServerOptions:
    extra = ("--gateway-replicas", "2") if which == TWO_GATEWAYS else ()
    return ServerOptions(model, prefill=1, decode=1 if which == ONE_DECODE else 2, extra=extra,
                         colocated=2 if which == TWO_COLOCATED else 0)


def run_matrix(model: str, keys: list[str], log_dir: Path, log: Callable[[str], None] = print,
               on_result: Callable[[ScenarioResult], None] | None = None) -> list[ScenarioResult]:
    """Run the scenarios `keys` (in SCENARIOS order), one harness per server kind."""
    chosen = [s for s in SCENARIOS if s.key in keys]
    results: list[ScenarioResult] = []
    for which in (TWO_DECODE, TWO_GATEWAYS, ONE_DECODE, TWO_COLOCATED, OWN):
        group = [s for s in chosen if s.server == which]
        if not group:
            continue
        count = WARM_UP + sum(s.probes for s in group)
        log(f"[{which}] computing {count} probes' greedy answers offline ...")
        probes = make_probes(model, count, seed=len(results) + 1, max_tokens=MAX_TOKENS, endpoints=ENDPOINTS)
        for s in group if which == OWN else [None]:
            opts = server_options(model, which if which != OWN else TWO_DECODE)
            sub = log_dir / (which if s is None else f"own-{s.key}")
            pools = f"{opts.colocated} colocated" if opts.colocated else f"{opts.prefill}P+{opts.decode}D"
            log(f"[{which}] starting pdserve serve ({' '.join([pools, *opts.extra])}) ...")
            h = Harness.start(opts, sub, probes, log=log)
            try:
                for sc in group if s is None else [s]:
                    log(f"[{sc.key}] {sc.title} ...")
                    try:
                        r = sc.run(h)
                    except Exception as e:  # noqa: BLE001 - one scenario's harness failure is its row's
                        r = ScenarioResult(sc.key, sc.title, failures=[f"harness error: {type(e).__name__}: {e}"])
                    results.append(r)
                    log(f"[{sc.key}] {'PASS' if r.passed else 'SKIP' if r.skipped else 'FAIL'} "
                        f"({r.elapsed_s:.0f} s) {'; '.join(r.failures)}")
                    if on_result is not None:
                        on_result(r)
            finally:
                h.close()
    order = {s.key: i for i, s in enumerate(SCENARIOS)}
    return sorted(results, key=lambda r: order[r.key])


def table(results: list[ScenarioResult]) -> str:
    """The matrix as a Markdown table."""
    rows = ["| scenario | requests | ok | clean errors | dropped | wrong | hung | lost | migrated | leaked blocks/"
            "regs/tasks/threads | recovery s (budget) | after recovery | result |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rec = "—" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        budget = "" if r.budget_s is None else f" ({r.budget_s:.1f})"
        migrated = int(r.counters.get("pdserve:request_migrations", 0)) if r.counters else "—"
        verdict = f"skipped: {r.skipped}" if r.skipped else "pass" if r.passed else "FAIL: " + "; ".join(r.failures)
        rows.append(f"| ({r.key}) {r.title} | {r.requests} | {r.ok} | {r.errors} | {r.dropped} | {r.wrong} | "
                    f"{r.hung} | {r.lost} | {migrated} | {r.leaks.short()} | {rec}{budget} | "
                    f"{r.after_ok}/{r.after_total} | {verdict} |")
    return "\n".join(rows)


def counters_line(r: ScenarioResult) -> str:
    """The cluster's own counts of what it did (the non-zero COUNTERS)."""
    return ", ".join(f"{COUNTERS[n]} {v:g}" for n, v in r.counters.items() if v) or "nothing counted"
