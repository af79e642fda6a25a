"""Chaos harness: a real `pdserve serve`, streaming greedy load whose answers are
known, faults on the pids of the processes it started, and the checks after each
(issue 13; the scenarios are in *_faults.py, their matrix in scenarios.py, its table
in bench/chaos.py, the CI subset in test_chaos.py). Its parts: what it reads of processes from /proc and the
links it cuts (procs.py), the probes and the load (load.py), what the workers still
hold afterwards (leaks.py), the server (server.py), the Ray view (ray_view.py); one
scenario's skeleton here.

- `Server` starts `pdserve serve` as a subprocess in a session of its own (every
  Ray process it starts stays in that session, so the harness can tell them from
  any other process on the machine, and stops only those), on free ports, with
  PDSERVE_FAULT_INJECTION=1 in its environment (which its Ray workers inherit).
- `RayView` joins the server's local Ray as a driver (the GCS address is in the
  session directory of the server's `gcs_server`) and reads every worker's
  `drain_state()`: its pid (`incarnation`), what it still holds, its tasks and
  threads.
- `make_probes` draws prompts (token ids, long enough that the router hands them
  to the prefill worker) and computes their greedy completions offline with
  `pdserve.LLM` on the same model: the oracle every streamed answer is held to.
- `run_load` runs N concurrent streaming clients over the probes; every read has
  a deadline, and each request ends as one `Outcome`: ok (exactly the expected
  text, every token), wrong, error (a clean error: an HTTP error status or an
  in-band error event), dropped (the connection ended without either), hung (a
  read or the request's deadline passed), closed (the client hung up on purpose).
- `run_fault` is one scenario's skeleton: baseline drain states, the load, the
  fault after K streamed chunks, the recovery watch (the pool back to size, a
  restarted worker answering from a new process, /health 200 "ok"), the drain
  and leak checks, and a few requests after recovery that must all be ok.

Linux only (/proc). Network: 127.0.0.1 only; `cut_links` uses `ss -K` (root).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.leaks import Leaks, Snapshot, counter_increase, extra_threads, leak_details, leaks
from chaos.load import Load, Outcome, Probe, Result, make_probes
from chaos.procs import (
    process_start,
)
from chaos.ray_view import RayView, born_at, pid_of
from chaos.server import Server, ServerOptions
from pdserve.cluster.reports import DrainState

# How long a worker's drain may take after the load: a gateway's orphans are
# aborted GATEWAY_GONE_S (10 s) after its link went down, looked at every 0.5 s.
DRAIN_TIMEOUT_S = 30.0


# --- one scenario --------------------------------------------------------------------


@dataclass
class Fault:
    """What a fault did: to whom, when (time.monotonic()), what it saw there."""

    what: str
    target: str = ""
    pid: int | None = None
    started: float = 0.0
    ended: float = 0.0  # recovery is timed from here (the kill, or the SIGCONT)
    note: str = ""
    in_flight: int | None = None  # requests on the target when it was struck (its jobs)


@dataclass
class ScenarioResult:
    key: str
    title: str
    requests: int = 0
    ok: int = 0
    errors: int = 0  # clean errors (excused ones: no survivor could serve them)
    dropped: int = 0  # connections cut (excused: the gateway or the server itself died)
    closed: int = 0  # hung up by the client on purpose
    wrong: int = 0
    hung: int = 0
    lost: int = 0  # not ok, though a survivor could have served them (errors and drops not excused)
    max_gap_s: float = 0.0  # the longest any request waited for a token (its first, or its next)
    leaks: Leaks = field(default_factory=Leaks)
    extra_threads: dict[str, list[str]] = field(default_factory=dict)  # per worker, beyond its baseline
    # COUNTERS' increase over the scenario (a gateway or worker that restarted starts its own from 0)
    counters: dict[str, float] = field(default_factory=dict)
    recovery_s: float | None = None  # fault end -> pool back to size and /health 200 "ok"
    budget_s: float | None = None  # recovery_budget(model load)
    after_ok: int = 0  # requests after recovery: all must be ok
    after_total: int = 0
    fault: Fault | None = None
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return not self.skipped and not self.failures

    def judge(self) -> None:
        f = self.failures
        if self.wrong:
            f.append(f"{self.wrong} wrong")
        if self.hung:
            f.append(f"{self.hung} hung")
        if self.lost:
            f.append(f"{self.lost} lost")
        if self.leaks.total:
            f.append(f"leaked {self.leaks}")
        if self.recovery_s is None:
            f.append("not recovered")
        elif self.budget_s is not None and self.recovery_s > self.budget_s:
            f.append(f"recovered in {self.recovery_s:.1f} s > {self.budget_s:.1f} s")
        if self.after_ok != self.after_total:
            f.append(f"{self.after_total - self.after_ok} of {self.after_total} failed after recovery")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        return d


def recovery_budget(load_s: float) -> float:
    """How long a fault's recovery may take, given a worker's (or the server's) start: its load
    again, half as much more, and 10 s. A worker restarted during a scenario loads beside the
    scenario's streaming load, which the first start did not have: on a 2-core machine held to
    0.4 of a CPU, the restarts took 1.4-1.5x the startup load (58-62 s against 41.4), where on an
    unloaded fast one they take less than it."""
    return 1.5 * load_s + 10.0


Excuse = Callable[[Result, Fault, float | None], bool]  # (result, fault, recovered at) -> not counted as lost
# (result, states before the fault, states after the drain): a scenario's own checks (notes, failures)
Check = Callable[[ScenarioResult, dict[str, DrainState | None], dict[str, DrainState | None]], None]


def never(_: Result, __: Fault, ___: float | None) -> bool:
    return False


def before_recovery(r: Result, fault: Fault, recovered_at: float | None) -> bool:
    """A request that was in flight at the fault or started before recovery (the only
    worker of a role, the gateway, or the server was down then)."""
    return r.ended >= fault.started and (recovered_at is None or r.started <= recovered_at)


@dataclass
class Harness:
    """One running server, the Ray view of it, and the probes: what scenarios share."""

    server: Server
    view: RayView
    probes: list[Probe]
    model_load_s: float  # the longest a worker took from process start to serving, at startup
    log: Callable[[str], None] = print
    next_probe: int = 0
    extra_probes: dict[str, list[Probe]] = field(default_factory=dict)
    # The last scenario's requests: its load's, and those after recovery (for its own checks).
    load_results: list[Result] = field(default_factory=list)
    after_results: list[Result] = field(default_factory=list)

    @classmethod
    def start(cls, opts: ServerOptions, log_dir: Path, probes: list[Probe], startup_timeout_s: float = 240.0,
              log: Callable[[str], None] = print) -> Harness:
        server = Server(opts, log_dir)
        server.start()
        view: RayView | None = None
        try:
            took = server.wait_healthy(startup_timeout_s)
            log(f"server up in {took:.1f} s on {server.url} (pid {server.sid})")
            view = RayView(server.ray_address())
            states = view.states(opts.worker_names())
            loads = [born_at(s) - (process_start(pid_of(s) or 0) or born_at(s)) for s in states.values() if s]
            h = cls(server, view, probes, max(loads, default=0.0), log)
            h.warm_up()
            return h
        except BaseException:
            if view is not None:
                view.close()
            server.stop()
            raise

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.view.close()
        self.server.stop()

    @property
    def names(self) -> list[str]:
        return self.server.opts.worker_names()

    def warm_up(self) -> None:
        """A fault-free pass at full concurrency (links, threads, caches made) that must be all ok."""
        results = self.load(Load(self.probes, requests=16, concurrency=8, offset=self.take(16)))
        bad = [r for r in results if r.outcome is not Outcome.OK]
        if bad:
            raise RuntimeError(f"fault-free warm-up: {len(bad)} of {len(results)} not ok: "
                               f"{[(r.outcome.value, r.detail) for r in bad[:3]]}")

    def probe_set(self, name: str, count: int, max_tokens: int, prompt_len: tuple[int, int]) -> list[Probe]:
        """Another set of probes (made once per harness, with their oracle)."""
        if name not in self.extra_probes:
            seed = 1000 + len(self.extra_probes)
            self.extra_probes[name] = make_probes(self.server.opts.model, count, seed, max_tokens, prompt_len,
                                                  self.server.opts.max_model_len, dtype=self.server.opts.dtype)
        return self.extra_probes[name]

    def take(self, n: int) -> int:
        """The offset of the next `n` probes (scenarios use fresh prompts: no prefix-cache hits)."""
        start = self.next_probe
        self.next_probe += n
        return start

    def load(self, load: Load) -> list[Result]:
        return asyncio.run(load.run(self.server.url))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Before a scenario: /health "ok", every worker answering and drained."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.server.health()
            states = self.view.states(self.names)
            if h is not None and h[0] == 200 and h[1].get("status") == "ok" and \
                    all(s is not None and s.drained for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready: health {h}, states {states}")
            time.sleep(0.5)

    def busiest(self, names: Sequence[str]) -> tuple[str, DrainState | None]:
        """The worker among `names` with the most requests now (jobs), and its state."""
        states = self.view.states(names, timeout_s=5.0)
        best = max(names, key=lambda n: s.jobs if (s := states[n]) is not None else -1)
        return best, states[best]

    def wait_for(self, names: Sequence[str], cond: Callable[[DrainState], bool], timeout_s: float = 10.0,
                 poll_s: float = 0.01) -> tuple[str, DrainState] | None:
        """Poll until one worker's state satisfies `cond` (a moment to strike)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, s in self.view.states(names, timeout_s=2.0).items():
                if s is not None and cond(s):
                    return name, s
            time.sleep(poll_s)
        return None

    def kill_worker(self, name: str, sig: signal.Signals = signal.SIGKILL, what: str = "SIGKILL",
                    state: DrainState | None = None) -> Fault:
        """Signal worker `name` (its pid from `state`, just read, or read now)."""
        s = state or self.view.states([name], timeout_s=5.0)[name]
        if s is None:
            raise RuntimeError(f"{name} does not answer: nothing to kill")
        pid = pid_of(s)
        assert pid is not None
        t = time.monotonic()
        self.server.send(pid, sig)
        return Fault(what, name, pid, t, t, f"{s.jobs} in flight on it", s.jobs)

    def kill_busiest(self, names: Sequence[str], sig: signal.Signals = signal.SIGKILL, what: str = "SIGKILL",
                     min_jobs: int = 2) -> Fault:
        """Strike the first of `names` seen with `min_jobs` requests or more (within 5 s),
        else the busiest."""
        seen = self.wait_for(names, lambda s: s.jobs >= min_jobs, timeout_s=5.0)
        name, state = seen if seen is not None else self.busiest(names)
        return self.kill_worker(name, sig, what, state)

    def run_fault(self, key: str, title: str, fault: Callable[[Load], Fault], load: Load, at_chunks: int,
                  restarted: bool = False, gateway_restart: bool = False, excuse: Excuse = never,
                  budget_s: float | None = None, after: int = 8, check: Check | None = None,
                  migrate: bool = False, ready: Callable[[], bool] | None = None) -> ScenarioResult:
        """The skeleton every scenario shares: baseline; `load` with `fault(load)` fired
        (in a thread) once `at_chunks` chunks streamed; the recovery watch from the
        fault's end (`restarted`: the fault's target must answer from a new process;
        `gateway_restart`: the gateway replica must be a new process); the drain and
        leak checks; `after` requests that must all be ok. `excuse` says which
        non-ok requests had no survivor to serve them. `check(result, before, after)`
        adds the scenario's own checks. `migrate`: the target had requests in flight when
        struck, and they moved (the gateway counted migrations). `ready()`: the scenario's own sign
        of recovery, which must hold too."""
        t0 = time.monotonic()
        res = ScenarioResult(key, title)
        self.wait_ready()
        before = self.baseline()
        counters_before = self.server.counters()
        gateway_before = frozenset(self.server.gateway_pids())
        budget = budget_s if budget_s is not None else recovery_budget(self.model_load_s)
        recovered: list[float] = []
        fault_box: list[Fault] = []

        async def scenario() -> list[Result]:
            reached = asyncio.Event()
            load.on_chunk = lambda n: reached.set() if n >= at_chunks else None

            async def strike() -> None:
                await reached.wait()
                f = await asyncio.to_thread(fault, load)
                fault_box.append(f)
                self.log(f"  [{key}] fault: {f.what} {f.target} (pid {f.pid}) {f.note}")
                restarts = [f.target] if restarted else []
                at = await asyncio.to_thread(self._watch_recovery, f, before.states, restarts, gateway_before,
                                             gateway_restart, max(budget * 3, 60.0), ready)
                if at is not None:
                    recovered.append(at)

            striker = asyncio.create_task(strike())
            results = await load.run(self.server.url)
            if not reached.is_set():
                striker.cancel()
                raise RuntimeError(f"the load ended after {load.chunks} chunks, before the fault's {at_chunks}")
            await striker
            return results

        results = self.load_results = asyncio.run(scenario())
        fault_ = fault_box[0]
        res.fault = fault_
        recovered_at = recovered[0] if recovered else None
        res.recovery_s = None if recovered_at is None else recovered_at - fault_.ended
        res.budget_s = budget
        self._count(res, results, fault_, recovered_at, excuse)
        self.after_recovery(res, after)
        final = self.drain(before)
        res.leaks = leaks(before, final)
        res.extra_threads = {n: extra for n in final.states
                             if (extra := extra_threads(before.threads.get(n), final.threads.get(n)))}
        if res.leaks.total:
            res.notes += leak_details(before, final)
        res.counters = counter_increase(counters_before, self.server.counters())
        if migrate and not fault_.in_flight:  # 0, or not known: no request had to move, none was shown to
            res.failures.append(f"no request was seen in flight on {fault_.target} when it was struck: "
                                "none had to migrate (the fault proved nothing)")
        elif migrate and not res.counters.get("pdserve:request_migrations"):
            res.failures.append(f"the {fault_.in_flight} requests on {fault_.target} did not migrate")
        if check is not None:
            check(res, before.states, final.states)
        res.judge()
        res.elapsed_s = time.monotonic() - t0
        return res

    def after_recovery(self, res: ScenarioResult, n: int) -> None:
        """`n` requests at once, after recovery: all must be ok (they reach the restarted worker
        too); kept in `after_results` for the scenario's own checks."""
        post = self.load(Load(self.probes, requests=n, concurrency=n, offset=self.take(n)))
        self.after_results = post
        res.after_total, res.after_ok = len(post), sum(r.outcome is Outcome.OK for r in post)
        for r in post:
            if r.outcome is not Outcome.OK:
                res.notes.append(f"after recovery: {r.outcome.value} {r.detail}")

    def snapshot(self) -> Snapshot:
        return Snapshot(self.view.states(self.names), self.view.thread_names(self.names))

    def baseline(self, timeout_s: float = 30.0) -> Snapshot:
        """A snapshot in which every worker answered (its state and its threads): `leaks` holds a
        worker's tasks and threads to its baseline only where it has one, so a late answer here
        would let that worker leak them unseen. RuntimeError at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot()
            silent = [n for n in self.names if snap.states.get(n) is None or snap.threads.get(n) is None]
            if not silent:
                return snap
            if time.monotonic() > deadline:
                raise RuntimeError(f"no baseline: {silent} did not answer within {timeout_s:g} s")
            time.sleep(0.5)

    def _count(self, res: ScenarioResult, results: list[Result], fault: Fault, recovered_at: float | None,
               excuse: Excuse) -> None:
        res.requests = len(results)
        res.max_gap_s = max((r.max_gap_s for r in results), default=0.0)
        for r in results:
            o = r.outcome
            res.ok += o is Outcome.OK
            res.wrong += o is Outcome.WRONG
            res.hung += o is Outcome.HUNG
            res.closed += o is Outcome.CLOSED
            if o in (Outcome.ERROR, Outcome.DROPPED):
                if excuse(r, fault, recovered_at):
                    res.errors += o is Outcome.ERROR
                    res.dropped += o is Outcome.DROPPED
                else:
                    res.lost += 1
            if o not in (Outcome.OK, Outcome.CLOSED) and len(res.notes) < 8:
                when = f"{r.started - fault.started:+.1f}..{r.ended - fault.started:+.1f} s"
                res.notes.append(f"request {r.index} ({r.endpoint}): {o.value} ({when} from the fault, {r.chunks} "
                                 f"chunks) {r.detail}")
        ok = collections.Counter(r.endpoint for r in results if r.outcome is Outcome.OK)
        sent = collections.Counter(r.endpoint for r in results)
        res.notes.append("ok by endpoint: " + ", ".join(f"{e} {ok[e]}/{n}" for e, n in sorted(sent.items())))

    def _watch_recovery(self, fault: Fault, before: dict[str, DrainState | None], restarts: Sequence[str],
                        gateway_before: frozenset[int], gateway_restart: bool, cap_s: float,
                        ready: Callable[[], bool] | None = None) -> float | None:
        """time.monotonic() when the pool was back to size (every worker answering; those
        in `restarts` from a new process; as many gateway replicas as before, with
        `gateway_restart` a new one among them), `ready()` held and /health was 200 "ok";
        None if not within `cap_s` of the fault's end."""
        deadline = fault.ended + cap_s
        while time.monotonic() < deadline:
            states = self.view.states(self.names, timeout_s=2.0)
            workers = all(s is not None for s in states.values()) and all(
                states[n] is not None and before[n] is not None
                and states[n].incarnation != before[n].incarnation  # type: ignore[union-attr]
                for n in restarts)
            gw = frozenset(self.server.gateway_pids())
            gateway = len(gw) >= max(1, len(gateway_before)) and (not gateway_restart or not gw <= gateway_before)
            if workers and gateway and (ready is None or ready()):
                h = self.server.health(timeout_s=2.0)
                if h is not None and h[0] == 200 and h[1].get("status") == "ok":
                    return time.monotonic()
            time.sleep(0.2)
        return None

    def drain(self, before: Snapshot, timeout_s: float = DRAIN_TIMEOUT_S) -> Snapshot:
        """Wait (bounded) until every worker holds nothing and its tasks and threads are
        back to the baseline; the snapshot then (or at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.snapshot()
            if leaks(before, now).total == 0 or time.monotonic() > deadline:
                return now
            time.sleep(0.5)
