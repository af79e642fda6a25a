"""Starting requests on a worker's inbox (cluster/worker_inbox.py, cluster/worker_channel.py,
workers/inbox_wire.py): what crosses the wire comes back as it was sent, garbage and forgeries
start nothing, and a try's end reaches the gateway however it ends."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.cluster.in_process import LocalActor
from pdserve.cluster.ray_errors import RayActorError
from pdserve.cluster.reports import WorkerInfo
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_inbox import Outcomes, TryFailed, WorkerInbox
from pdserve.workers.async_engine import EngineDeadError, RequestFaultError, WorkerDrainingError
from pdserve.workers.handoff import Resume, ServeRequest
from pdserve.workers.inbox_wire import AbortTry, StartTry, decode_inbox, encode_abort, encode_start
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.structured_outputs import StructuredOutputs
from pdserve.workers.token_stream import StreamLostError
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

SECRET = ClusterSecret(b"k" * 32)
GATEWAY = "tcp://127.0.0.1:5555"  # the requests' reply_to: their gateway's token stream

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3, max_tokens=64, min_tokens=2,
                   stop=["\n\n", "END"], stop_token_ids=[2, 7], logprobs=5, prompt_logprobs=1,
                   include_stop_str_in_output=True, skip_special_tokens=False, presence_penalty=0.5,
                   frequency_penalty=-0.25, repetition_penalty=1.1, logit_bias={5: -100.0, 9: 2.5},
                   speculative=False, cache_salt="tenant-a", output_kind=RequestOutputKind.DELTA),
    SamplingParams(structured_outputs=StructuredOutputs(json={"type": "object"}, origin="response_format")),
    SamplingParams(structured_outputs=StructuredOutputs(choice=("yes", "no"))),
    SamplingParams(structured_outputs=StructuredOutputs(json_object=True)),
]


def request(params: SamplingParams = PARAMS[0], rid: str = "r1", attempt: int = 0,
            resume: Resume | None = None) -> ServeRequest:
    return ServeRequest(rid, (1, 2, 3), params, 30.0, GATEWAY, attempt, resume)


@pytest.mark.parametrize("params", PARAMS)
def test_a_start_reads_back_as_the_request_sent(params: SamplingParams) -> None:
    req = request(params, attempt=2, resume=Resume((4, 5), 7, -1.5))
    msg = decode_inbox(encode_start("gw", 9, req, prefill_worker="prefill-0"))
    assert msg == StartTry("gw", 9, req, "prefill-0")
    assert decode_inbox(encode_abort("gw", 10, "r1", 2)) == AbortTry("gw", 10, "r1", 2)


def _start_body(**change: Any) -> list[Any]:
    body = msgpack.unpackb(encode_start("gw", 1, request()), strict_map_key=False)
    fields = ["version", "kind", "sender", "seq", "request_id", "prompt", "params", "timeout_s", "reply_to",
              "attempt", "resume", "prefill"]
    for name, value in change.items():
        body[fields.index(name)] = value
    return list(body)


@pytest.mark.parametrize("change, names", [
    ({"version": 2}, "version"),
    ({"kind": "run"}, "kind"),
    ({"seq": -1}, "seq"),
    ({"request_id": ""}, "request_id"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "abc"}, "prompt"),
    ({"params": {"temperature": -1}}, "temperature"),
    ({"params": {"tool": 1}}, "unknown fields"),
    ({"params": {"logit_bias": {1.5: 1.0}}}, "logit_bias"),
    ({"params": {"output_kind": "all"}}, "output_kind"),
    ({"params": {"structured_outputs": {"json": "{", "exec": 1}}}, "structured_outputs"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"attempt": -1}, "attempt"),
    ({"resume": [[], 0, None]}, "resume"),
    ({"resume": [[1], 0, "x"]}, "cumulative_logprob"),
    ({"prefill": 5}, "prefill_worker"),
])
def test_a_malformed_start_is_a_value_error_naming_the_field(change: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        decode_inbox(msgpack.packb(_start_body(**change)))


@pytest.mark.parametrize("data", [b"", b"\xc1", os.urandom(64), msgpack.packb({"a": 1}), msgpack.packb([1])])
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_inbox(data)


def test_try_errors_come_back_as_their_types() -> None:
    for error in (ValueError("prompt: too long"), TimeoutError("late"), RequestFaultError("nan"),
                  EngineDeadError("dead"), WorkerDrainingError("switching"), StreamLostError("lost"),
                  KeyError("bug")):
        back = TryFailed.of("r", 0, error).error()
        assert type(back) is (RuntimeError if isinstance(error, KeyError) else type(error))
        assert str(back) == str(error)


class FakeService:
    """A worker with the inbox's end of things: `runner` says how each try goes."""

    def __init__(self, runner: Callable[[StartTry], Awaitable[None]], secret: ClusterSecret = SECRET) -> None:
        self.started: list[StartTry] = []
        self.aborted: list[tuple[str, int]] = []
        self.cancelled: list[str] = []
        self._runner = runner
        self.incarnation = os.urandom(4).hex()
        self.inbox = WorkerInbox(self._run, lambda rid, a: self.aborted.append((rid, a)), secret, "127.0.0.1",
                                 self.incarnation)

    async def _run(self, start: StartTry) -> None:
        self.started.append(start)
        try:
            await self._runner(start)
        except asyncio.CancelledError:
            self.cancelled.append(start.request.request_id)
            raise

    async def info(self) -> WorkerInfo:
        return WorkerInfo(1, 1, inbox=self.inbox.open(), incarnation=self.incarnation)

    async def outcomes(self, gateway: str, timeout_s: float) -> Outcomes:
        return await self.inbox.outcomes(gateway, timeout_s)


async def _eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)


def test_a_try_ends_when_its_final_delta_came_or_with_its_error() -> None:
    async def runner(start: StartTry) -> None:
        if start.request.request_id == "bad":
            raise ValueError("prompt: longer than the model's context")
        await asyncio.sleep(3600)  # "running": its final delta is what ends it here

    async def main() -> None:
        svc = FakeService(runner)
        channel = WorkerChannel(LocalActor(svc), GATEWAY, SECRET)
        try:
            finished = asyncio.Event()
            ok = asyncio.create_task(channel.run(request(), finished))
            await _eventually(lambda: len(svc.started) == 1)
            assert svc.started[0].request == request() and not ok.done()
            finished.set()
            await asyncio.wait_for(ok, 5)
            with pytest.raises(ValueError, match="longer than the model's context"):
                await asyncio.wait_for(channel.run(request(rid="bad"), asyncio.Event()), 5)
        finally:
            await channel.close()
            svc.inbox.close()

    asyncio.run(main())


def test_an_abort_follows_its_start_and_cancels_the_try() -> None:
    async def runner(start: StartTry) -> None:
        await asyncio.sleep(3600)

    async def main() -> None:
        svc = FakeService(runner)
        channel = WorkerChannel(LocalActor(svc), GATEWAY, SECRET)
        try:
            run = asyncio.create_task(channel.run(request(attempt=1), asyncio.Event()))
            await _eventually(lambda: channel.connected)
            assert channel.abort("r1", 1)  # sent at once after the start: never before it
            await _eventually(lambda: svc.aborted == [("r1", 1)])
            await _eventually(lambda: svc.inbox.num_tries == 0)
            assert [s.request.request_id for s in svc.started] in ([], ["r1"])  # cancelled before or as it ran
            run.cancel()
        finally:
            await channel.close()
            svc.inbox.close()

    asyncio.run(main())


def test_the_workers_death_fails_its_tries_and_the_next_one_finds_its_new_life() -> None:
    async def runner(start: StartTry) -> None:
        await asyncio.sleep(3600)

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
            await _eventually(lambda: len(first.started) == 3)
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
            await _eventually(lambda: len(second.started) == 1)
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
    async def runner(start: StartTry) -> None:
        await asyncio.sleep(3600)

    async def main() -> None:
        svc = FakeService(runner)
        address = svc.inbox.open()
        body = encode_start("attacker-knows-the-format", 1, request())
        loop = asyncio.get_running_loop()
        other = ClusterSecret(b"o" * 32)
        # Another secret; a tag for another inbox; no tag; then a good one, and the good one again.
        await loop.run_in_executor(None, _send_raw, address, [auth.inbox_tag(other, address, body), body])
        await loop.run_in_executor(None, _send_raw, address,
                                   [auth.inbox_tag(SECRET, "tcp://127.0.0.1:1", body), body])
        await loop.run_in_executor(None, _send_raw, address, [body])
        # The token stream's tag over the same bytes is no inbox tag either.
        await loop.run_in_executor(None, _send_raw, address, [auth.token_tag(SECRET, address, body), body])
        await _eventually(lambda: svc.inbox.num_forged == 4)
        assert svc.started == []
        good = [auth.inbox_tag(SECRET, address, body), body]
        await loop.run_in_executor(None, _send_raw, address, good)
        await _eventually(lambda: len(svc.started) == 1)
        await loop.run_in_executor(None, _send_raw, address, good)
        await _eventually(lambda: svc.inbox.num_replayed == 1)
        # Signed garbage is counted and dropped; the inbox goes on reading.
        junk = msgpack.packb([1, "start", "s", 5])
        await loop.run_in_executor(None, _send_raw, address, [auth.inbox_tag(SECRET, address, junk), junk])
        await _eventually(lambda: svc.inbox.num_rejected == 1)
        assert len(svc.started) == 1
        svc.inbox.close()

    asyncio.run(main())


def test_a_gateway_that_never_polls_again_holds_a_bounded_number_of_failures() -> None:
    async def runner(start: StartTry) -> None:
        raise ValueError("no")

    async def main() -> None:
        from pdserve.cluster import worker_inbox

        svc = FakeService(runner)
        svc.inbox.open()
        for i in range(worker_inbox._MAX_KEPT + 10):
            svc.inbox._start(StartTry("s", i + 1, request(rid=f"r{i}")))
        await _eventually(lambda: svc.inbox.num_tries == 0)
        got = await svc.inbox.outcomes(request().reply_to, 0)
        assert len(got.failed) == worker_inbox._MAX_KEPT
        assert got.failed[-1].request_id == f"r{worker_inbox._MAX_KEPT + 9}"  # the newest are kept
        svc.inbox.close()

    asyncio.run(main())
