"""Test doubles for a worker's inbox and a gateway's channel to it (cluster/worker_inbox.py,
cluster/worker_channel.py): the requests the tests send, a fake worker service, its handle that
lets a test step into each poll."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

from pdserve.cluster import worker_channel
from pdserve.cluster.in_process import LocalActor
from pdserve.cluster.reports import WorkerInfo
from pdserve.cluster.worker_channel import WorkerChannel
from pdserve.cluster.worker_inbox import Outcomes, WorkerInbox
from pdserve.workers.handoff import Resume, ServeRequest
from pdserve.workers.inbox_wire import StartTry
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.structured_outputs import StructuredOutputs
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

class FakeService:
    """A worker with the inbox's end of things: `runner` says how each try goes."""

    def __init__(self, runner: Callable[[StartTry], Awaitable[None]], secret: ClusterSecret = SECRET) -> None:
        self.started: list[StartTry] = []
        self.aborted: list[tuple[str, int]] = []
        self.cancelled: list[str] = []
        self._runner = runner
        self.incarnation = os.urandom(4).hex()
        self.engine_error: BaseException | None = None  # what ended its engine (a test sets it)
        self.inbox = WorkerInbox(self._run, lambda rid, a: self.aborted.append((rid, a)), secret, "127.0.0.1",
                                 self.incarnation, engine_error=lambda: self.engine_error)

    async def _run(self, start: StartTry) -> None:
        self.started.append(start)
        try:
            await self._runner(start)
        except asyncio.CancelledError:
            self.cancelled.append(start.request.request_id)
            raise

    async def info(self) -> WorkerInfo:
        return WorkerInfo(1, 1, inbox=self.inbox.open(), incarnation=self.incarnation)

    async def outcomes(self, gateway: str, after: int, timeout_s: float) -> Outcomes:
        return await self.inbox.outcomes(gateway, after, timeout_s)


async def hang(start: StartTry) -> None:
    """A try that runs until its final delta ends it (here, until it is cancelled)."""
    await asyncio.sleep(3600)


@contextlib.asynccontextmanager
async def channel_to(runner: Callable[[StartTry], Awaitable[None]] | FakeService,
                     ) -> AsyncIterator[tuple[FakeService, WorkerChannel]]:
    """A worker running `runner` for each try (or the service given), and a gateway's channel
    to it; both closed after."""
    svc = runner if isinstance(runner, FakeService) else FakeService(runner)
    channel = WorkerChannel(LocalActor(svc), GATEWAY, SECRET)
    try:
        yield svc, channel
    finally:
        await channel.close()
        svc.inbox.close()


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.01)

class Polled(LocalActor):
    """A worker's handle that lets a test step into each poll: `poll(call)` runs its `outcomes`
    call (`polls` counts them, this one included)."""

    def __init__(self, svc: FakeService) -> None:
        super().__init__(svc)
        self.svc, self.polls = svc, 0

    async def poll(self, call: Coroutine[Any, Any, Any]) -> Any:
        return await call

    def __getattr__(self, name: str) -> Any:
        actor = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Awaitable[Any]:
                async def call() -> Any:
                    if name != "outcomes":
                        return await getattr(actor.svc, name)(*args)
                    actor.polls += 1
                    return await actor.poll(getattr(actor.svc, name)(*args))

                return asyncio.ensure_future(call())

        return Method()

def quick_polls(monkeypatch: pytest.MonkeyPatch, confirm_s: float = 30.0) -> None:
    monkeypatch.setattr(worker_channel, "POLL_S", 0.1)
    monkeypatch.setattr(worker_channel, "_CALL_GRACE_S", 0.3)
    monkeypatch.setattr(worker_channel, "START_CONFIRM_S", confirm_s)
