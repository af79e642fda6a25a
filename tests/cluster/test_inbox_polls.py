"""A gateway's channel to a worker's inbox (cluster/worker_channel.py) when its polls, starts,
aborts or connection go wrong: lost answers, failed calls, stalled connects, a dropped link. A
try's end still reaches the gateway, and nothing is sent twice or left waiting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from inbox_doubles import GATEWAY, SECRET, FakeService, Polled, channel_to, eventually, hang, quick_polls, request

from pdserve.cluster import worker_channel
from pdserve.cluster.in_process import LocalActor
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.reports import WorkerInfo
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_inbox import FAILED, Outcomes
from pdserve.workers.async_engine import RequestAbortedError
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.inbox_wire import StartTry
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.structured_outputs import StructuredOutputs
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.token_stream import StreamLostError


class _Flaky(Polled):
    """A worker's handle whose first poll's answer is lost on the way (the call never returns)."""

    async def poll(self, call: Coroutine[Any, Any, Any]) -> Any:
        got = await call
        if self.polls == 1:
            await asyncio.sleep(3600)
        return got

def test_a_failure_whose_poll_was_lost_still_reaches_its_try(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_polls(monkeypatch)

    async def runner(start: StartTry) -> None:
        raise ValueError("prompt: too long")

    async def main() -> None:
        svc = FakeService(runner)
        actor = _Flaky(svc)
        channel = WorkerChannel(actor, GATEWAY, SECRET)
        try:
            with pytest.raises(ValueError, match="too long"):
                await asyncio.wait_for(channel.run(request(), asyncio.Event()), 10)
            assert actor.polls >= 2  # it came on the poll after the lost one
        finally:
            await channel.close()
            svc.inbox.close()

    asyncio.run(main())


def test_a_try_the_worker_reports_done_returns_without_its_final_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker sent its final delta; the collector's `watch` gives it a grace from here."""
    quick_polls(monkeypatch)

    async def runner(start: StartTry) -> None:
        return None

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            await asyncio.wait_for(channel.run(request(), asyncio.Event()), 5)

    asyncio.run(main())


def test_a_start_lost_on_the_way_fails_its_try_as_a_lost_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_polls(monkeypatch, confirm_s=0.5)

    runner = hang

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            finished = asyncio.Event()
            taken = asyncio.create_task(channel.run(request(rid="taken"), finished))
            await eventually(lambda: len(svc.started) == 1)
            sent = channel._send
            monkeypatch.setattr(channel, "_send", lambda body: None)  # the start goes nowhere
            with pytest.raises(StreamLostError, match="not taken"):
                await asyncio.wait_for(channel.run(request(rid="lost"), asyncio.Event()), 10)
            monkeypatch.setattr(channel, "_send", sent)
            assert not taken.done()  # one the worker took runs on, however long
            finished.set()
            await asyncio.wait_for(taken, 5)

    asyncio.run(main())


def test_an_abort_that_came_before_the_start_sends_no_start() -> None:
    runner = hang

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            assert not channel.abort("r1", 0)  # not connected: the caller also tells the worker by Ray
            with pytest.raises(RequestAbortedError):
                await asyncio.wait_for(channel.run(request(), asyncio.Event()), 5)
            run = asyncio.create_task(channel.run(request(attempt=1), asyncio.Event()))  # its next try runs
            await eventually(lambda: len(svc.started) == 1)
            run.cancel()

    asyncio.run(main())


def test_an_abort_that_came_before_its_start_keeps_the_start_from_running() -> None:
    """Where its channel cannot take an abort (the worker's inbox is full: the try's start still
    queues there), the gateway aborts by a Ray call (`abort`), which overtakes the start. The
    start, taken after, ran for a client that was gone, to its end; now it fails at once as
    aborted. Other requests, and a later try of the aborted one, run as ever."""
    async def main() -> None:
        svc = FakeService(hang)
        svc.inbox.open()
        svc.inbox.abort("r1", 1)  # the Ray call, first
        svc.inbox._start(StartTry("s", 1, request(rid="r1", attempt=1)))  # then its start, off the inbox
        svc.inbox._start(StartTry("s", 2, request(rid="r1", attempt=0)))  # an earlier try's: ended too
        svc.inbox._start(StartTry("s", 3, request(rid="r2")))
        await eventually(lambda: len(svc.started) >= 1)
        assert [s.request.request_id for s in svc.started] == ["r2"]
        got = await svc.inbox.outcomes(GATEWAY, 0, 0)
        failed = {(r.request_id, r.attempt): r.kind for r in got.reports if r.state == FAILED}
        assert failed == {("r1", 1): "aborted", ("r1", 0): "aborted"}
        svc.inbox._start(StartTry("s", 4, request(rid="r1", attempt=2)))  # its next try runs
        await eventually(lambda: len(svc.started) == 2)
        assert svc.started[1].request.attempt == 2
        svc.inbox.close()

    asyncio.run(main())


def test_a_request_over_the_inbox_limit_is_a_value_error_and_the_channel_goes_on() -> None:
    runner = hang

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            huge = ServeRequest("big", tuple([70_000] * 1_000_000), SamplingParams(), 30.0, GATEWAY)
            with pytest.raises(ValueError, match="over the"):
                await asyncio.wait_for(channel.run(huge, asyncio.Event()), 5)
            run = asyncio.create_task(channel.run(request(), asyncio.Event()))
            await eventually(lambda: len(svc.started) == 1)
            run.cancel()

    asyncio.run(main())


def test_a_broken_poll_fails_the_tries_it_was_watching(monkeypatch: pytest.MonkeyPatch) -> None:
    """However the poll loop ends (here a bug: an answer it cannot read), no try waits on it."""
    quick_polls(monkeypatch)

    runner = hang

    class Garbled(LocalActor):
        def __init__(self, svc: FakeService) -> None:
            super().__init__(svc)
            self.svc = svc

        def __getattr__(self, name: str) -> Any:
            svc = self.svc

            class Method:
                @staticmethod
                def remote(*args: Any) -> Awaitable[Any]:
                    async def call() -> Any:
                        got = await getattr(svc, name)(*args)
                        return Outcomes(got.incarnation, (object(),)) if name == "outcomes" else got  # type: ignore[arg-type]

                    return asyncio.ensure_future(call())

            return Method()

    async def main() -> None:
        svc = FakeService(runner)
        channel = WorkerChannel(Garbled(svc), GATEWAY, SECRET)
        try:
            with pytest.raises(RayActorError):
                await asyncio.wait_for(channel.run(request(), asyncio.Event()), 5)
        finally:
            await channel.close()
            svc.inbox.close()

    asyncio.run(main())


def test_a_discarded_channel_fails_its_tries_and_sends_no_more() -> None:
    runner = hang

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            run = asyncio.create_task(channel.run(request(), asyncio.Event()))
            await eventually(lambda: len(svc.started) == 1)
            channel.discard()
            with pytest.raises(RayActorError):
                await asyncio.wait_for(run, 5)
            with pytest.raises(RuntimeError, match="closing"):
                await channel.run(request(rid="r2"), asyncio.Event())

    asyncio.run(main())


class _Stopped(FakeService):
    """A worker whose first `info` never answers (the process is stopped), the later ones do."""

    def __init__(self, runner: Callable[[StartTry], Awaitable[None]]) -> None:
        super().__init__(runner)
        self.infos = 0

    async def info(self) -> WorkerInfo:
        self.infos += 1
        if self.infos == 1:
            await asyncio.sleep(3600)
        return await super().info()


def test_tries_waiting_for_a_stalled_workers_connect_fail_when_it_is_given_up() -> None:
    """The stall watch gives a worker up while a try waits for the channel's connect (its
    `info` call, to a stopped process): the try fails then with the watch's error, not at
    the call's 30 s deadline; the next try connects again."""

    async def main() -> None:
        stopped = _Stopped(hang)
        async with channel_to(stopped) as (svc, channel):
            waiting = [asyncio.create_task(channel.run(request(rid=f"r{i}"), asyncio.Event())) for i in range(2)]
            await eventually(lambda: stopped.infos == 1)
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in waiting)
            channel.fail_tries(lambda: StreamLostError("given up: stalled"))
            for t in waiting:
                with pytest.raises(StreamLostError, match="stalled"):
                    await asyncio.wait_for(t, 2)
            finished = asyncio.Event()
            again = asyncio.create_task(channel.run(request(rid="r9"), finished))
            await eventually(lambda: len(svc.started) == 1)
            finished.set()
            await asyncio.wait_for(again, 5)

    asyncio.run(main())


def test_a_caller_cancelled_while_connecting_leaves_the_others_connect_alone() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        class Slow(FakeService):
            async def info(self) -> WorkerInfo:
                await gate.wait()
                return await super().info()

        async with channel_to(Slow(hang)) as (svc, channel):
            leaving = asyncio.create_task(channel.run(request(rid="gone"), asyncio.Event()))
            finished = asyncio.Event()
            staying = asyncio.create_task(channel.run(request(rid="stays"), finished))
            await asyncio.sleep(0.05)
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
            gate.set()
            await eventually(lambda: [s.request.request_id for s in svc.started] == ["stays"])
            finished.set()
            await asyncio.wait_for(staying, 5)

    asyncio.run(main())


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_connect_begun_right_after_a_give_up_leaves_the_waiters_error(depth: int) -> None:
    """A try starts connecting a loop turn or two after the give-up stopped the connect, before
    the stopped connect's waiters woke: they still fail with the give-up's error (moved on by
    the gateway), not with a bare cancellation (a 500 for their clients)."""

    async def main() -> None:
        stopped = _Stopped(hang)
        loop = asyncio.get_running_loop()
        late: list[asyncio.Task[None]] = []
        async with channel_to(stopped) as (_, channel):

            def start(n: int) -> None:
                if n:
                    loop.call_soon(start, n - 1)
                else:
                    late.append(asyncio.create_task(channel.run(request(rid="late"), asyncio.Event())))

            try:
                waiting = [asyncio.create_task(channel.run(request(rid=f"r{i}"), asyncio.Event()))
                           for i in range(2)]
                await eventually(lambda: stopped.infos == 1)
                channel.fail_tries(lambda: StreamLostError("given up: stalled"))
                loop.call_soon(start, depth)
                for t in waiting:
                    with pytest.raises(StreamLostError, match="stalled"):
                        await asyncio.wait_for(t, 2)
            finally:
                for t in late:
                    t.cancel()

    asyncio.run(main())


def test_a_channel_discarded_while_it_connects_fails_its_waiters_as_on_a_death() -> None:
    async def main() -> None:
        stopped = _Stopped(hang)
        async with channel_to(stopped) as (_, channel):
            waiting = asyncio.create_task(channel.run(request(), asyncio.Event()))
            await eventually(lambda: stopped.infos == 1)
            channel.discard()
            with pytest.raises(RayActorError):
                await asyncio.wait_for(waiting, 2)
            assert not waiting.cancelled()

    asyncio.run(main())


def test_an_abort_by_ray_ends_a_try_the_inbox_started_before_its_engine_has_it(
        make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where its channel is down (its poll broke, or the inbox is full), the gateway aborts a try by
    a Ray call (`abort`), not on the inbox. The engine's abort ends only a request it holds: a try
    still on its way in (its grammar compiling) went on, and then ran to its end for no one."""
    from pdserve.cluster.actors import EngineService
    from pdserve.workers.config import EngineConfig

    model = make_model(tiny_spec())
    svc = EngineService(EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=64), 1, worker_name="w")

    async def main() -> None:
        compiled = asyncio.Event()
        waiting: list[SamplingParams] = []

        async def grammar_ready(params: SamplingParams) -> None:
            waiting.append(params)
            await compiled.wait()

        monkeypatch.setattr(svc.async_engine, "grammar_ready", grammar_ready)
        opened: list[str] = []
        real_open = svc.async_engine.open

        def open_job(request_id: str, *args: Any, **kw: Any) -> Any:
            opened.append(request_id)
            return real_open(request_id, *args, **kw)

        monkeypatch.setattr(svc.async_engine, "open", open_job)
        svc.inbox.open()
        constrained = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(choice=("yes", "no")))
        svc.inbox._start(StartTry("s", 1, request(constrained)))
        await eventually(lambda: bool(waiting))
        await svc.abort("r1", 0)
        compiled.set()  # the grammar is ready now: an aborted try must not go on into the engine
        await eventually(lambda: svc.inbox.num_tries == 0 or bool(opened))
        assert opened == []  # it never reached the engine
        await eventually(lambda: svc.inbox.num_tries == 0)

    try:
        asyncio.run(main())
    finally:
        svc.close()


def test_an_abort_lost_on_the_way_is_sent_again_until_the_worker_answers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection dropped and made again loses what was in flight: an abort lost so left its
    try decoding on the worker, for no one, to its end. The worker answers an abort (the try's
    failure report); one unanswered after ABORT_CONFIRM_S is sent again, and once answered, no
    more."""
    quick_polls(monkeypatch)
    monkeypatch.setattr(worker_channel, "ABORT_CONFIRM_S", 0.3)

    async def main() -> None:
        async with channel_to(hang) as (svc, channel):
            run = asyncio.create_task(channel.run(request(), asyncio.Event()))
            await eventually(lambda: len(svc.started) == 1)
            sent = channel._send
            monkeypatch.setattr(channel, "_send", lambda body: None)  # the abort goes nowhere
            assert channel.abort("r1", 0)
            monkeypatch.setattr(channel, "_send", sent)
            await asyncio.sleep(0.1)
            assert svc.aborted == [] and svc.inbox.num_tries == 1  # lost: the try runs on
            await eventually(lambda: svc.aborted == [("r1", 0)])
            await eventually(lambda: svc.inbox.num_tries == 0)
            with pytest.raises(RequestAbortedError):
                await asyncio.wait_for(run, 5)
            await asyncio.sleep(1.0)  # answered: not sent again
            assert svc.aborted == [("r1", 0)] and not channel._unanswered_aborts

    asyncio.run(main())


async def _at_once(start: StartTry) -> None:
    """A try that ends as soon as it starts (the worker reports it done)."""


def test_an_abort_of_a_try_already_over_or_never_started_is_sent_once(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """An abort the worker cannot answer (it has no try of it: one it reported done, or one whose
    start was never sent, its client gone first) was taken for lost: sent again every
    ABORT_CONFIRM_S, three times, then logged as never answered, for a try that never ran on for
    no one. It is sent once (a try still there is ended by it), and nothing is said of it."""
    quick_polls(monkeypatch)
    monkeypatch.setattr(worker_channel, "ABORT_CONFIRM_S", 0.1)

    async def main() -> None:
        async with channel_to(_at_once) as (svc, channel):
            await asyncio.wait_for(channel.run(request(), asyncio.Event()), 5)  # reported done
            assert channel.abort("r1", 0)  # (its final delta lost on the way, say)
            assert channel.abort("r2", 0)  # its start never sent
            await asyncio.sleep(1.0)  # past every re-send the old code made
            assert sorted(svc.aborted) == [("r1", 0), ("r2", 0)]
            assert not channel._unanswered_aborts

    with caplog.at_level(logging.WARNING, logger=worker_channel.__name__):
        asyncio.run(main())
    assert "never answered" not in caplog.text


class _PollFails(Polled):
    """A worker's handle whose first `fails` polls raise an error that is not the worker's
    death (a Ray call that failed: a full object store, a broken connection to its node)."""

    def __init__(self, svc: FakeService, fails: int) -> None:
        super().__init__(svc)
        self.fails = fails

    async def poll(self, call: Coroutine[Any, Any, Any]) -> Any:
        if self.polls <= self.fails:
            call.close()
            raise RuntimeError("the call failed on the way")
        return await call


@pytest.mark.parametrize("fails", [1, 100])
def test_a_poll_that_fails_without_the_workers_death_is_tried_again(monkeypatch: pytest.MonkeyPatch,
                                                                      fails: int) -> None:
    """Any poll error used to be taken for the worker's death: its tries moved elsewhere at once
    and the worker, alive, decoded them on for no one. Now one failure is polled through (the try
    runs on); a worker whose polls keep failing is given up, its tries aborted there first."""
    quick_polls(monkeypatch)
    monkeypatch.setattr(worker_channel, "_POLL_RETRY_S", (0.05, 0.05, 0.05))

    async def main() -> None:
        svc = FakeService(hang)
        channel = WorkerChannel(_PollFails(svc, fails), GATEWAY, SECRET)
        try:
            finished = asyncio.Event()
            run = asyncio.create_task(channel.run(request(), finished))
            await eventually(lambda: len(svc.started) == 1)
            if fails == 1:
                await eventually(lambda: channel.connected and svc.inbox.num_tries == 1)
                await asyncio.sleep(0.5)  # past the failed poll and its retry
                assert not run.done() and svc.aborted == []
                finished.set()
                await asyncio.wait_for(run, 5)
            else:
                with pytest.raises(RayActorError):  # given up: the gateway moves the try
                    await asyncio.wait_for(run, 5)
                await eventually(lambda: svc.aborted == [("r1", 0)])  # and the worker dropped it
                await eventually(lambda: svc.inbox.num_tries == 0)
        finally:
            await channel.close()
            svc.inbox.close()

    asyncio.run(main())


class _Proxy:
    """A TCP relay between a channel and an inbox that can drop what the channel sends
    (`swallow`) and cut its connections (`cut`): a connection dropped and made again, losing
    what was in flight (a worker stopped past the heartbeat timeout does this)."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.swallow = target_port, False
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ir, iw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [cw, iw]

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, upstream: bool) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await r.read(65536):
                    if not (upstream and self.swallow):
                        w.write(data)
                        await w.drain()
            w.close()

        await asyncio.gather(pump(cr, iw, True), pump(ir, cw, False))

    def cut(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


def test_starts_in_flight_when_the_link_drops_fail_at_once_not_after_the_confirm_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A start written before the inbox's connection dropped may be lost with it (a worker
    SIGSTOPped 5 s lost two or three so, and their clients waited 30 s, START_CONFIRM_S, with
    no byte). When the link drops, a try the worker has not reported taking fails at once, as a
    lost stream (the gateway moves it), and its abort follows on the next connection; a try
    it took runs on, and the channel serves on."""
    monkeypatch.setattr(worker_channel, "POLL_S", 0.1)

    async def main() -> None:
        svc = FakeService(hang)
        real = svc.inbox.open()
        proxy = _Proxy(int(real.rsplit(":", 1)[1]))
        svc.inbox.address = await proxy.start()  # the channel connects (and signs) to the relay

        async def info() -> WorkerInfo:
            return WorkerInfo(1, 1, inbox=svc.inbox.address, incarnation=svc.incarnation)

        svc.info = info  # type: ignore[method-assign]
        async with channel_to(svc) as (_, channel):
            taken = asyncio.create_task(channel.run(request(rid="taken"), asyncio.Event()))
            await eventually(lambda: len(svc.started) == 1 and channel._tries[("taken", 0)].started)
            proxy.swallow = True
            lost = asyncio.create_task(channel.run(request(rid="lost"), asyncio.Event()))
            await asyncio.sleep(0.3)
            proxy.cut()
            proxy.swallow = False
            with pytest.raises(StreamLostError, match="link"):
                await asyncio.wait_for(lost, 5)  # not START_CONFIRM_S (30 s)
            await eventually(lambda: ("lost", 0) in svc.aborted)  # its abort came on the new connection
            assert [s.request.request_id for s in svc.started] == ["taken"] and not taken.done()
            after = asyncio.create_task(channel.run(request(rid="after"), asyncio.Event()))
            await eventually(lambda: len(svc.started) == 2)
            for t in (taken, after):
                t.cancel()
        proxy.close()

    asyncio.run(main())
