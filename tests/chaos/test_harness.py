"""The chaos harness's own judgement, without a cluster: a request's outcome from what
a (fake) server streamed, the thread and counter accounting, the excuses, the verdict."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chaos.harness import Fault, ScenarioResult, before_recovery
from chaos.leaks import Leaks, Snapshot, counter_increase, extra_threads, leaks
from chaos.load import Load, Outcome, Probe, Result, read_event, request_of
from chaos.server import ServerOptions
from pdserve.cluster.reports import DrainState

PROBE = Probe((5, 6, 7), 3, "abc")


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _chunk(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"completion_tokens": 3}}
# What the fake server sends, by the first prompt token of the request (`None`: hang up
# after the headers and the first chunk; "hang": send a chunk, then nothing).
BEHAVIOURS: dict[int, tuple[int, bytes | None | str]] = {
    5: (200, _sse(_chunk("a"), _chunk("b"), _chunk("c", "length"), USAGE, "[DONE]")),
    6: (200, _sse(_chunk("a"), _chunk("x"), _chunk("c", "length"), USAGE, "[DONE]")),  # wrong text
    7: (200, _sse(_chunk("a"), _chunk("b", "length"), {"choices": [], "usage": {"completion_tokens": 2}},
                  "[DONE]")),  # short
    8: (200, _sse(_chunk("a"), {"error": {"message": "no healthy decode worker", "type": "X", "code": 503}},
                  "[DONE]")),
    9: (503, json.dumps({"error": {"message": "at capacity", "type": "ServiceUnavailableError"}}).encode()),
    10: (200, None),  # the connection drops mid-stream
    11: (200, "hang"),  # one chunk, then silence
}


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    """A plain asyncio HTTP server on 127.0.0.1 (its own loop in a thread) that answers
    each completion by BEHAVIOURS[its first prompt token]."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = json.loads(await reader.readexactly(length))
        status, payload = BEHAVIOURS[body["prompt"][0]]
        if status != 200:
            assert isinstance(payload, bytes)
            writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
                         "connection: close\r\n\r\n".encode() + payload)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            if isinstance(payload, bytes):
                writer.write(payload)
            else:
                writer.write(_sse(_chunk("a")))
                await writer.drain()
                if payload == "hang":
                    await asyncio.sleep(3)
        await writer.drain()
        writer.close()

    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(handle, "127.0.0.1", 0), loop).result(10)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        async def stop() -> None:
            server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_each_stream_is_judged_by_what_arrived(fake_url: str) -> None:
    probes = [Probe((first, 1, 2), 3, "abc") for first in sorted(BEHAVIOURS)]
    load = Load(probes, requests=len(probes), concurrency=len(probes), read_timeout_s=1.0, deadline_s=3.0,
                pause_after_error_s=0.0)
    results = asyncio.run(load.run(fake_url))
    outcomes = {probes[r.probe].prompt[0]: r.outcome for r in results}
    assert outcomes == {5: Outcome.OK, 6: Outcome.WRONG, 7: Outcome.WRONG, 8: Outcome.ERROR, 9: Outcome.ERROR,
                        10: Outcome.DROPPED, 11: Outcome.HUNG}
    by_first = {probes[r.probe].prompt[0]: r for r in results}
    assert by_first[8].status == 503 and "no healthy decode worker" in by_first[8].detail
    assert by_first[9].status == 503 and "at capacity" in by_first[9].detail
    assert load.chunks == sum(r.chunks for r in results)


def test_a_client_that_hangs_up_is_closed_not_lost(fake_url: str) -> None:
    event = asyncio.Event()
    event.set()
    load = Load([PROBE], requests=2, concurrency=2, hang_up_if=lambda i: i == 0, hang_up=event)
    results = asyncio.run(load.run(fake_url))
    assert [r.outcome for r in results] == [Outcome.CLOSED, Outcome.OK]


def _state(jobs: int = 0, blocks: int = 0, tasks: int = 1, threads: int = 5, incarnation: str = "1-0") -> DrainState:
    return DrainState(jobs, jobs, blocks, 0, tasks, threads, 0, incarnation)


def test_threads_are_counted_by_kind_ports_masked_pools_left_out() -> None:
    before = ["MainThread [_MainThread]", "kv-send tcp://127.0.0.1:1000 [Thread]", "kv-wait_0 [Thread]"]
    # A restarted peer's link under another port is the same kind; pools and pyzmq's gc thread grow freely.
    after_ok = ["MainThread [_MainThread]", "kv-send tcp://127.0.0.1:2000 [Thread]", "kv-wait_0 [Thread]",
                "kv-wait_1 [Thread]", "Thread-3 [GarbageCollectorThread]"]
    assert extra_threads(before, after_ok) == []
    leaked = [*after_ok, "kv-send tcp://127.0.0.1:1000 [Thread]"]
    assert extra_threads(before, leaked) == ["kv-send tcp://* [Thread]"]
    snap_before = Snapshot({"w": _state(threads=3)}, {"w": before})
    assert leaks(snap_before, Snapshot({"w": _state(threads=6)}, {"w": after_ok})) == Leaks()
    assert leaks(snap_before, Snapshot({"w": _state(threads=7)}, {"w": leaked})) == Leaks(threads=1)
    # Without names, by count; what a worker holds counts whatever its baseline.
    assert leaks(snap_before, Snapshot({"w": _state(jobs=1, blocks=2, tasks=2, threads=4)}, {"w": None})) == \
        Leaks(requests=2, blocks=2, tasks=1, threads=1)
    assert leaks(snap_before, Snapshot({"w": None}, {"w": None})) == Leaks(unanswered=1)


def test_counters_that_restarted_count_from_zero() -> None:
    assert counter_increase({"a": 5.0, "b": 7.0}, {"a": 8.0, "b": 2.0, "c": 1.0}) == {"a": 3.0, "b": 2.0, "c": 1.0}


def test_excuses_and_the_verdict() -> None:
    fault = Fault("SIGKILL", "w", 1, started=10.0, ended=10.0)
    during = Result(0, 0, Outcome.DROPPED, started=9.0, ended=10.5)
    before_it = Result(1, 0, Outcome.DROPPED, started=1.0, ended=2.0)
    after_it = Result(2, 0, Outcome.ERROR, started=30.0, ended=30.1)
    assert before_recovery(during, fault, 20.0)
    assert not before_recovery(before_it, fault, 20.0)
    assert not before_recovery(after_it, fault, 20.0)
    assert before_recovery(after_it, fault, None)  # never recovered: nothing after it
    r = ScenarioResult("x", "x", recovery_s=5.0, budget_s=10.0, after_ok=8, after_total=8)
    r.judge()
    assert r.passed
    r = ScenarioResult("x", "x", wrong=1, hung=1, lost=1, leaks=Leaks(blocks=1), recovery_s=11.0, budget_s=10.0,
                       after_ok=7, after_total=8)
    r.judge()
    assert not r.passed and len(r.failures) == 6


class _Unstruck:
    """A server the load reaches (the fake one) but that a fault never strikes: the scenario
    must end because its load ended before the fault's chunk count, not wait for the fault."""

    def __init__(self, url: str) -> None:
        self.url, self.startup_s, self.sid = url, 1.0, 0
        self.opts = ServerOptions("unused")

    def kill_main(self, sig: object) -> int:
        raise AssertionError("the fault struck: the load never streamed a chunk")


class _NoRay:
    def close(self) -> None:
        pass


def _in_thread(fn: Callable[[], object], timeout_s: float) -> tuple[bool, BaseException | None]:
    """Run `fn` in a daemon thread: (whether it ended within `timeout_s`, what it raised)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive(), (raised[0] if raised else None)


def test_a_server_kill_whose_load_ends_before_the_fault_fails_instead_of_waiting(fake_url: str) -> None:
    """Every request refused (503): no chunk streams, the fault's moment never comes; (i) must
    say so as run_fault does, not wait for it forever."""
    from chaos.harness import Harness
    from chaos.server_faults import server_killed

    refused = [Probe((9, 1, 2), 3, "abc")]
    h = Harness(_Unstruck(fake_url), _NoRay(), refused, model_load_s=1.0, log=lambda _: None)  # type: ignore[arg-type]
    h.wait_ready = lambda timeout_s=60.0: None  # type: ignore[method-assign]
    ended, raised = _in_thread(lambda: server_killed(h), timeout_s=20.0)
    assert ended, "server_killed still waiting for a fault 20 s after its load began"
    assert isinstance(raised, RuntimeError) and "before the fault" in str(raised), raised


class _Uncut:
    """A harness whose links never show up to be cut: the KV link is never seen awaited, the
    token links are not there. Its `run_fault` runs a scenario's fault, its check and the
    verdict, as Harness.run_fault does after a load with nothing else wrong."""

    def __init__(self) -> None:
        self.server = self
        self.opts = ServerOptions("unused")
        self.view = self

    def states(self, names: list[str], timeout_s: float = 5.0) -> dict[str, DrainState | None]:
        return {n: _state(incarnation=f"{1000 + i}-0") for i, n in enumerate(names)}

    def wait_for(self, *_: object, **__: object) -> None:
        return None

    def gateway_pid(self) -> int:
        return 999

    def kill_worker(self, name: str, *_: object, **__: object) -> Fault:
        return Fault("SIGKILL", name, 1000, 0.0, 0.0, "0 in flight on it", 0)

    def probe_set(self, *_: object) -> list[Probe]:
        return [PROBE]

    def take(self, n: int) -> int:
        return 0

    @property
    def probes(self) -> list[Probe]:
        return [PROBE]

    def run_fault(self, key: str, title: str, fault: Callable[[Load], Fault], load: Load, at_chunks: int,
                  check: Callable[[ScenarioResult, dict[str, DrainState | None], dict[str, DrainState | None]],
                                  None] | None = None, **_: object) -> ScenarioResult:
        res = ScenarioResult(key, title, requests=1, ok=1, recovery_s=0.0, budget_s=10.0, after_ok=8, after_total=8)
        res.fault = fault(load)
        if check is not None:
            check(res, {}, {})
        res.judge()
        return res


@pytest.mark.parametrize("key", ["g1", "g2"])
def test_a_link_cut_that_cut_nothing_fails(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(g1) and (g2) strike by `ss -K`; when no connection was there to cut (the KV never seen
    awaited, no token link found), nothing was struck: the scenario proved nothing and must fail."""
    from chaos import link_faults

    monkeypatch.setattr(link_faults, "can_cut_links", lambda: True)
    monkeypatch.setattr(link_faults, "links", lambda *_: [])
    monkeypatch.setattr(link_faults, "loopback_ports", lambda _: set())
    monkeypatch.setattr(link_faults, "cut_links", lambda conns: len(conns))
    monkeypatch.setattr(time, "sleep", lambda _: None)  # the pauses between cuts
    run = link_faults.kv_link_cut if key == "g1" else link_faults.token_link_cut
    res = run(_Uncut())  # type: ignore[arg-type]
    assert res.fault is not None and "0 connections cut" in res.fault.note, res.fault
    assert not res.passed, f"{key} passed with nothing cut: {res.failures}"


def test_stop_continues_only_its_own_stopped_processes(tmp_path: Path) -> None:
    """A process the harness stopped can die stopped ((j): Ray kills it), and its pid can then be
    another's: `stop` must not signal a process outside the server's sessions (here one stopped
    by someone else, under a pid the harness once stopped)."""
    import signal
    import subprocess

    from chaos.procs import stopped
    from chaos.server import Server

    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        os.kill(other.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not stopped(other.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped(other.pid)
        server = Server(ServerOptions("unused"), tmp_path)
        server.sid = 2**22 + 7  # a session of no live process: the server's, long gone
        server._frozen.add(other.pid)  # the pid it stopped, now someone else's
        server.stop(timeout_s=1.0)
        assert stopped(other.pid), "stop continued a process that is not the server's"
    finally:
        other.kill()
        other.wait(5)


class _Restarted:
    """A `pdserve serve` that (i) kills and starts again at once: the fake server answers for both."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.url, self.log_path, self.startup_s, self.sid = url, log_path, 1.0, 2**22 + 9
        self.opts = ServerOptions("unused")
        self.proc = self

    def wait(self, timeout: float) -> int:
        return 0

    def kill_main(self, sig: object) -> int:
        return self.sid

    def pids(self) -> list[int]:
        return []

    def restart(self) -> None:
        pass

    def wait_healthy(self, timeout_s: float) -> float:
        return 1.0

    def ray_address(self) -> str:
        return "127.0.0.1:1"


class _Workers:
    """The new run's workers: once `leaking`, each holds 6 more tasks and threads than before."""

    def __init__(self) -> None:
        self.leaking = False

    def close(self) -> None:
        pass

    def states(self, names: list[str], timeout_s: float = 5.0) -> dict[str, DrainState | None]:
        n = 9 if self.leaking else 3
        return {name: _state(tasks=n, threads=n) for name in names}

    def thread_names(self, names: list[str], timeout_s: float = 5.0) -> dict[str, list[str] | None]:
        extra = [f"leak-{i} [Thread]" for i in range(6 if self.leaking else 0)]
        return {name: ["MainThread [_MainThread]", "a [Thread]", "b [Thread]", *extra] for name in names}


def test_a_server_restart_whose_new_workers_leak_threads_fails(fake_url: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """(i) checks the new run's workers after its requests; with no baseline of theirs, tasks and
    threads left by those requests (6 of each here) could never count: it must measure them."""
    from chaos import server_faults
    from chaos.base import AFTER
    from chaos.harness import Harness

    workers = _Workers()
    monkeypatch.setattr(server_faults, "AT_CHUNKS", 10)  # the fake server's streams are 3 chunks each
    monkeypatch.setattr(server_faults, "DRAIN_TIMEOUT_S", 1.0)
    monkeypatch.setattr(server_faults, "RayView", lambda _address: workers)
    log = tmp_path / "serve.log"
    log.write_text("")
    h = Harness(_Restarted(fake_url, log), workers, [PROBE], model_load_s=1.0, log=lambda _: None)  # type: ignore[arg-type]
    h.wait_ready = lambda timeout_s=60.0: None  # type: ignore[method-assign]
    after_recovery = h.after_recovery

    def leaving_threads(res: ScenarioResult, n: int) -> None:
        after_recovery(res, n)
        workers.leaking = True

    h.after_recovery = leaving_threads  # type: ignore[method-assign]
    res = server_faults.server_killed(h)
    assert res.after_ok == res.after_total == AFTER and res.recovery_s is not None, res
    assert res.leaks.tasks and res.leaks.threads, res.leaks
    assert not res.passed


@pytest.mark.parametrize("key", ["b1", "b2"])
def test_a_prefill_kill_that_missed_its_moment_fails(key: str) -> None:
    """(b1) kills the prefill worker mid-prefill, (b2) mid-transfer; when the wait for that
    moment runs out the worker is killed anyway: that kill is not the scenario's, and it must
    not pass as one."""
    from chaos import worker_faults

    run = worker_faults.prefill_killed_mid_prefill if key == "b1" else worker_faults.prefill_killed_mid_transfer
    res = run(_Uncut())  # type: ignore[arg-type]
    assert res.fault is not None and "killed anyway" in res.fault.note, res.fault
    assert not res.passed, f"{key} passed with its moment missed: {res.failures}"


class _Steady:
    """A server that answers (the fake one), is healthy, counts nothing and keeps its gateway."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.opts = ServerOptions("unused")

    def health(self, timeout_s: float = 2.0) -> tuple[int, dict[str, object]]:
        return 200, {"status": "ok"}

    def counters(self, timeout_s: float = 5.0) -> dict[str, float]:
        return {}

    def gateway_pids(self) -> list[int]:
        return [1]


def test_a_kill_that_must_move_requests_but_found_none_in_flight_fails(fake_url: str) -> None:
    """(a), (e), (h), (j), (n): the struck worker's requests in flight must move. A strike on a
    worker with none in flight (the wait for a busy one ran out) moved nothing and proved nothing:
    the scenario must fail, not skip the check."""
    from chaos.harness import Harness

    h = Harness(_Steady(fake_url), _Workers(), [PROBE], model_load_s=1.0, log=lambda _: None)  # type: ignore[arg-type]

    def idle_kill(_: Load) -> Fault:
        t = time.monotonic()
        return Fault("SIGKILL", "pdserve-decode-0", 1000, t, t, "0 in flight on it", 0)

    res = h.run_fault("x", "idle decode worker SIGKILL", idle_kill, Load([PROBE], requests=8, concurrency=4), 3,
                      migrate=True, after=2)
    assert res.requests == 8 and res.ok == 8 and res.after_ok == 2 and not res.leaks.total, res
    assert not res.passed, "a kill with nothing in flight passed as one whose requests moved"


class _LateAnswer(_Workers):
    """Workers whose drain states miss the baseline's read once (a slow answer on a loaded
    machine), answer every other read, and leak tasks and threads once `leaking`."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def states(self, names: list[str], timeout_s: float = 5.0) -> dict[str, DrainState | None]:
        self.reads += 1
        return dict.fromkeys(names) if self.reads == 2 else super().states(names, timeout_s)


def test_a_worker_that_missed_the_baseline_is_still_held_to_one(fake_url: str) -> None:
    """run_fault's baseline is read once the cluster is ready (the 1st read: wait_ready; the 2nd:
    the baseline). A worker whose answer to it is late has no baseline, and then tasks and threads
    it leaks after the fault (6 of each here) must still count."""
    from chaos.harness import Harness

    workers = _LateAnswer()
    h = Harness(_Steady(fake_url), workers, [PROBE], model_load_s=1.0, log=lambda _: None)  # type: ignore[arg-type]
    drain = h.drain
    h.drain = lambda before, timeout_s=1.0: drain(before, timeout_s)  # type: ignore[method-assign]  # the leak stays

    def leaking_kill(_: Load) -> Fault:
        workers.leaking = True
        t = time.monotonic()
        return Fault("SIGKILL", "pdserve-decode-0", 1000, t, t, "2 in flight on it", 2)

    res = h.run_fault("x", "a kill that leaves threads", leaking_kill, Load([PROBE], requests=8, concurrency=4), 3,
                      after=2)
    assert res.leaks.tasks and res.leaks.threads, res.leaks
    assert not res.passed


def test_chat_and_responses_streams_are_read_as_completions_are() -> None:
    """The load reads each endpoint's own events: text pieces, the finish, usage, an
    in-band error (a Responses error's code is its type: 500 for InternalServerError)."""
    def read(endpoint: str, *payloads: object) -> tuple[str, str | None, int | None, object, bool]:
        evs = [read_event(endpoint, p if isinstance(p, str) else json.dumps(p)) for p in payloads]
        return ("".join(e.text for e in evs), next((e.finish for e in evs if e.finish), None),
                next((e.tokens for e in evs if e.tokens is not None), None),
                next((e.error[0] for e in evs if e.error), None), evs[-1].done)

    chat = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 3}}, "[DONE]"]
    assert read("chat", *chat) == ("abc", "length", 3, None, True)
    responses = [{"type": "response.created", "response": {}},
                 {"type": "response.output_text.delta", "delta": "ab"},
                 {"type": "response.output_text.delta", "delta": "c"},
                 {"type": "response.output_text.done", "text": "abc"},
                 {"type": "response.incomplete", "response": {"usage": {"output_tokens": 3}}}]
    assert read("responses", *responses) == ("abc", "length", 3, None, True)
    assert read("responses", responses[1], {"type": "response.completed", "response": {"usage": {
        "output_tokens": 1}}})[1:] == ("stop", 1, None, True)
    assert read("responses", responses[1], {"type": "error", "code": "InternalServerError", "message": "x"},
                )[3] == 500
    path, body = request_of(Probe((5, 6), 3, "abc", "responses", "hi"))
    assert path == "/v1/responses" and body["input"] == "hi" and body["max_output_tokens"] == 3
    path, body = request_of(Probe((5, 6), 3, "abc", "chat", "hi"))
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
