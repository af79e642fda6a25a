"""Starting requests on a worker's inbox (cluster/worker_inbox.py, cluster/worker_channel.py,
workers/inbox_wire.py): what crosses the wire comes back as it was sent, garbage and forgeries
start nothing, and a try's end reaches the gateway however it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import zmq
from inbox_doubles import GATEWAY, SECRET, FakeService, channel_to, eventually, hang, request

from pdserve.cluster.in_process import LocalActor
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_inbox import DONE, FAILED, STARTED
from pdserve.workers.async_engine import EngineDeadError
from pdserve.workers.inbox_wire import StartTry, encode_start
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret


def test_a_try_ends_when_its_final_delta_came_or_with_its_error() -> None:
    async def runner(start: StartTry) -> None:
        if start.request.request_id == "bad":
            raise ValueError("prompt: longer than the model's context")
        await asyncio.sleep(3600)  # "running": its final delta is what ends it here

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            finished = asyncio.Event()
            ok = asyncio.create_task(channel.run(request(), finished))
            await eventually(lambda: len(svc.started) == 1)
            assert svc.started[0].request == request() and not ok.done()
            finished.set()
            await asyncio.wait_for(ok, 5)
            with pytest.raises(ValueError, match="longer than the model's context"):
                await asyncio.wait_for(channel.run(request(rid="bad"), asyncio.Event()), 5)

    asyncio.run(main())


def test_a_try_that_trips_on_the_way_out_of_a_dead_engine_fails_of_the_death() -> None:
    """An error of no known kind is a 500 for the client, unless the worker's engine is dead:
    then what the try tripped over on the way out (a KV registration the death freed) is not
    the cause, and the gateway gets EngineDeadError, which moves the request elsewhere."""
    async def runner(start: StartTry) -> None:
        raise KeyError(f"request {start.request.request_id!r} is not registered")

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            with pytest.raises(RuntimeError, match="is not registered"):  # a live engine: a bug, said as one
                await asyncio.wait_for(channel.run(request(rid="a"), asyncio.Event()), 5)
            svc.engine_error = RuntimeError("a tensor-parallel step failed")
            with pytest.raises(EngineDeadError, match="tensor-parallel step failed.*is not registered"):
                await asyncio.wait_for(channel.run(request(rid="b"), asyncio.Event()), 5)
            svc.started.clear()

            async def refused(start: StartTry) -> None:
                raise ValueError("prompt: too long")
            svc._runner = refused  # a known kind stays itself, dead engine or not
            with pytest.raises(ValueError, match="too long"):
                await asyncio.wait_for(channel.run(request(rid="c"), asyncio.Event()), 5)

    asyncio.run(main())


def test_a_try_whose_work_was_cancelled_inside_the_worker_fails_at_once() -> None:
    """Work a try awaited was cancelled inside the worker (a role's wait threads shut down as it
    changed role): the try's task ends with CancelledError though no abort cancelled it. The
    gateway hears at once (StreamLostError: the request moves on), not at the request's deadline."""
    async def runner(start: StartTry) -> None:
        loop = asyncio.get_running_loop()
        waiting = loop.create_future()
        loop.call_later(0.05, waiting.cancel)  # what `shutdown(cancel_futures=True)` does to a queued wait
        await waiting

    async def main() -> None:
        async with channel_to(runner) as (_, channel):
            with pytest.raises(StreamLostError, match="was cancelled"):
                await asyncio.wait_for(channel.run(request(), asyncio.Event()), 5)

    asyncio.run(main())


def test_an_abort_follows_its_start_and_cancels_the_try() -> None:
    runner = hang

    async def main() -> None:
        async with channel_to(runner) as (svc, channel):
            run = asyncio.create_task(channel.run(request(attempt=1), asyncio.Event()))
            await eventually(lambda: channel.connected)
            assert channel.abort("r1", 1)  # sent at once after the start: never before it
            await eventually(lambda: svc.aborted == [("r1", 1)])
            await eventually(lambda: svc.inbox.num_tries == 0)
            assert [s.request.request_id for s in svc.started] in ([], ["r1"])  # cancelled before or as it ran
            run.cancel()

    asyncio.run(main())


def test_the_workers_death_fails_its_tries_and_the_next_one_finds_its_new_life() -> None:
    runner = hang

    class Mortal(LocalActor):
        def __init__(self, svc: FakeService) -> None:
            super().__init__(svc)
            self.svc, self.dead = svc, False
            self.polls: list[asyncio.Future[Any]] = []

        def __getattr__(self, name: str) -> Any:
            actor = self

            class Method:
                @staticmethod
                def remote(*args: Any) -> asyncio.Future[Any]:
                    async def call() -> Any:
                        if actor.dead:
                            raise RayActorError()
                        try:
                            return await getattr(actor.svc, name)(*args)
                        except asyncio.CancelledError:
                            raise RayActorError() from None

                    fut = asyncio.ensure_future(call())
                    actor.polls.append(fut)
                    return fut

            return Method()

    async def main() -> None:
        first = FakeService(runner)
        actor = Mortal(first)
        channel = WorkerChannel(actor, GATEWAY, SECRET)
        try:
            runs = [asyncio.create_task(channel.run(request(rid=f"r{i}"), asyncio.Event())) for i in range(3)]
            await eventually(lambda: len(first.started) == 3)
            actor.dead = True
            for call in actor.polls:
                call.cancel()  # the process died: Ray fails its calls in flight
            for run in runs:
                with pytest.raises(RayActorError):
                    await asyncio.wait_for(run, 5)
            assert not channel.connected
            first.inbox.close()
            second = FakeService(runner)
            actor.svc, actor.dead = second, False  # Ray restarted it: a new process, a new inbox
            again = asyncio.create_task(channel.run(request(rid="r9"), asyncio.Event()))
            await eventually(lambda: len(second.started) == 1)
            assert second.started[0].request.request_id == "r9"
            again.cancel()
            second.inbox.close()
        finally:
            await channel.close()

    asyncio.run(main())


def _send_raw(address: str, parts: list[bytes]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with ctx.socket(zmq.PUSH) as sock:
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(address)
        sock.send_multipart(parts)


def test_forged_replayed_and_misaddressed_messages_start_nothing() -> None:
    runner = hang

    async def main() -> None:
        svc = FakeService(runner)
        address = svc.inbox.open()
        bound = svc.inbox.tag_address  # the inbox and its process's life
        body = encode_start("attacker-knows-the-format", 1, request())
        loop = asyncio.get_running_loop()
        other = ClusterSecret(b"o" * 32)
        # Another secret; a tag for another inbox; for this address's last life (a restarted worker
        # on the same port); no tag; then a good one, and the good one again.
        await loop.run_in_executor(None, _send_raw, address, [auth.inbox_tag(other, bound, body), body])
        await loop.run_in_executor(None, _send_raw, address,
                                   [auth.inbox_tag(SECRET, "tcp://127.0.0.1:1#" + svc.incarnation, body), body])
        await loop.run_in_executor(None, _send_raw, address, [auth.inbox_tag(SECRET, address + "#old", body), body])
        await loop.run_in_executor(None, _send_raw, address, [body])
        # The token stream's tag over the same bytes is no inbox tag either.
        await loop.run_in_executor(None, _send_raw, address, [auth.token_tag(SECRET, bound, body), body])
        await eventually(lambda: svc.inbox.num_forged == 5)
        assert svc.started == []
        good = [auth.inbox_tag(SECRET, bound, body), body]
        await loop.run_in_executor(None, _send_raw, address, good)
        await eventually(lambda: len(svc.started) == 1)
        await loop.run_in_executor(None, _send_raw, address, good)
        await eventually(lambda: svc.inbox.num_replayed == 1)
        # Signed garbage is counted and dropped; the inbox goes on reading.
        junk = msgpack.packb([1, "start", "s", 5])
        await loop.run_in_executor(None, _send_raw, address, [auth.inbox_tag(SECRET, bound, junk), junk])
        await eventually(lambda: svc.inbox.num_rejected == 1)
        assert len(svc.started) == 1
        svc.inbox.close()

    asyncio.run(main())


def test_a_gateway_that_never_polls_again_holds_a_bounded_number_of_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cluster import worker_inbox

    monkeypatch.setattr(worker_inbox, "_MAX_KEPT", 100)

    async def runner(start: StartTry) -> None:
        raise ValueError("no")

    async def main() -> None:
        svc = FakeService(runner)
        svc.inbox.open()
        for i in range(200):
            svc.inbox._start(StartTry("s", i + 1, request(rid=f"r{i}")))
        await eventually(lambda: svc.inbox.num_tries == 0)
        got = await svc.inbox.outcomes(request().reply_to, 0, 0)
        assert len(got.reports) == 100
        assert got.reports[-1].request_id == "r199" and got.reports[-1].state == FAILED  # the newest are kept
        svc.inbox.close()

    asyncio.run(main())


def test_reports_stay_until_a_poll_acknowledges_them() -> None:
    """A poll whose answer was lost (its caller gave up on it) loses no failure: the next
    poll, which acknowledges only what the gateway handled, gets it again."""

    async def runner(start: StartTry) -> None:
        if start.request.request_id == "bad":
            raise ValueError("no")

    async def main() -> None:
        svc = FakeService(runner)
        svc.inbox.open()
        svc.inbox._start(StartTry("s", 1, request(rid="ok")))
        svc.inbox._start(StartTry("s", 2, request(rid="bad")))
        await eventually(lambda: svc.inbox.num_tries == 0)
        lost = await svc.inbox.outcomes(GATEWAY, 0, 0)  # answered; never handled
        again = await svc.inbox.outcomes(GATEWAY, 0, 0)
        assert again == lost
        states = {(r.request_id, r.state) for r in again.reports}
        assert states == {("ok", STARTED), ("ok", DONE), ("bad", STARTED), ("bad", FAILED)}
        last = again.reports[-1].seq
        assert [r.seq for r in again.reports] == list(range(1, last + 1))
        assert (await svc.inbox.outcomes(GATEWAY, last, 0)).reports == ()
        # A failure wakes a waiting poll at once; taken and done tries wait for the poll's time.
        waiting = asyncio.create_task(svc.inbox.outcomes(GATEWAY, last, 30))
        await asyncio.sleep(0.05)
        svc.inbox._start(StartTry("s", 3, request(rid="fine")))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        svc.inbox._start(StartTry("s", 4, request(rid="bad", attempt=1)))
        got = await asyncio.wait_for(waiting, 5)
        assert [(r.request_id, r.state) for r in got.reports][-1] == ("bad", FAILED)
        svc.inbox.close()

    asyncio.run(main())
