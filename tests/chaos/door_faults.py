"""The chaos scenarios that strike the front door: the gateway replica killed ((c)), one of
two replicas killed ((m)), the HAProxy ingress killed ((l))."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

from chaos.base import AT_CHUNKS, load_for
from chaos.harness import Fault, Harness, ScenarioResult, before_recovery
from chaos.load import HealthSample, HealthWatch, Load, Outcome, Probe, Result
from chaos.procs import cmdline
from pdserve.cluster.reports import DrainState

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

    load = load_for(h, long_streams=[dataclasses.replace(orphan, prompt=(100 + i, *orphan.prompt))
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
    load = load_for(h, concurrency=REPLICA_CONCURRENCY, long_streams=longs, check_long=True)
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

    return h.run_fault("l", "HAProxy ingress SIGKILL", fault, load_for(h), AT_CHUNKS, excuse=before_recovery,
                       budget_s=INGRESS_BUDGET_S)
