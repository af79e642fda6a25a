"""A worker that makes tokens as fast as it is asked, with no model: the test double of
bench/door.py, which measures the gateway tier (HAProxy, the gateway replica, the token
stream's receiving end) apart from any engine.

`FakeEngine` stands in for a colocated worker's engine thread (workers/async_engine.py):
each step it adds one token to every running request and sends the step's deltas in one
message per gateway with the real `TokenStreamPublisher`, then tells the callers of the
requests whose final delta went out. `FakeWorker` is the actor around it with the methods
the colocated gateway backend calls (cluster/backend.py ColocatedBackend, the metrics route,
the drain checks: cluster/actors.py EngineService has the real ones). Every token is
`FAKE_TOKEN_ID`, its text `FAKE_TEXT`: a request of `max_tokens` tokens streams
`FAKE_TEXT * max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.cluster.reports import DrainState, LoadReport, Progress, WorkerInfo
from pdserve.cluster.worker_inbox import Outcomes, WorkerInbox
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.inbox_wire import StartTry
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.token_stream import TokenStreamPublisher
from pdserve.workers.transfer import auth
from pdserve.workers.transfer.auth import ClusterSecret

FAKE_TOKEN_ID = 42
FAKE_TEXT = " tok"
MAX_MODEL_LEN = 4096  # what `info` reports: the gateway bounds prompts and max_tokens by it
_IDLE_WAIT_S = 0.5  # the loop's wait for a command while nothing runs (then it checks for stop)
_GONE_CHECK_S = 1.0  # how often the loop looks for gateways gone (a replica deleted between runs)


@dataclass(eq=False)
class _Running:
    """One request on the fake engine thread."""

    req: ServeRequest
    total: int  # output tokens the request ends at (its resume's included)
    sent: int  # output tokens its client has
    done: Callable[[BaseException | None], None]  # hands the caller its end (any thread)


class FakeEngine:
    """The engine thread: steps every `step_s` (0: back to back while any request runs).
    `submit` and `abort` are called from any thread; the loop alone touches its publisher
    and its running requests."""

    def __init__(self, worker_id: str, step_s: float = 0.0) -> None:
        if step_s < 0:
            raise ValueError(f"step_s: must be >= 0, got {step_s}")
        self.step_s = step_s
        self.steps = 0  # steps that sent tokens
        self.tokens = 0  # tokens sent
        self._publisher = TokenStreamPublisher(worker_id)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def submit(self, req: ServeRequest, done: Callable[[BaseException | None], None]) -> None:
        max_tokens = req.params.max_tokens or MAX_MODEL_LEN - len(req.prompt_token_ids)
        run = _Running(req, total=max_tokens, sent=req.offset, done=done)
        self._commands.put(lambda: self._start(run))

    def abort(self, request_id: str, attempt: int | None) -> None:
        def drop() -> None:
            run = self._running.get(request_id)
            if run is not None and (attempt is None or run.req.attempt <= attempt):
                del self._running[request_id]
                run.done(RuntimeError(f"request {request_id} was aborted"))

        self._commands.put(drop)

    def close(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=5)

    def _start(self, run: _Running) -> None:
        old = self._running.get(run.req.request_id)
        if old is not None:  # a later try replaces the earlier one, as on a real worker
            old.done(RuntimeError(f"request {run.req.request_id}: superseded"))
        self._running[run.req.request_id] = run
        self._publisher.watch(run.req.reply_to)

    def _run(self) -> None:
        next_step = next_gone_check = time.monotonic()
        while not self._stop.is_set():
            self._drain_commands(block=not self._running)
            if time.monotonic() >= next_gone_check:  # as the real engine loop: its socket closed, its requests ended
                next_gone_check = time.monotonic() + _GONE_CHECK_S
                self._end_requests_of(set(self._publisher.gone()))
            if not self._running:
                next_step = time.monotonic()
                continue
            if self.step_s:
                wait = next_step - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                next_step = max(next_step + self.step_s, time.monotonic())
            self._step()
        self._publisher.close()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _step(self) -> None:
        """One token for every running request, one message per gateway, then the finished ones' ends."""
        finished: list[_Running] = []
        for run in self._running.values():
            last = run.sent + 1 >= run.total
            c = CompletionOutput(0, FAKE_TEXT, [FAKE_TOKEN_ID], finish_reason="length" if last else None)
            out = RequestOutput(run.req.request_id, None, [], [c], finished=last)
            self._publisher.add(run.req.reply_to, out, run.sent, run.req.attempt)
            run.sent += 1
            if last:
                finished.append(run)
        lost = set(self._publisher.flush())
        self.steps += 1
        self.tokens += len(self._running)
        for run in finished:
            del self._running[run.req.request_id]
            run.done(None)
        for rid in lost & set(self._running):
            self._running.pop(rid).done(RuntimeError(f"{rid}: its gateway stopped reading tokens"))

    def _end_requests_of(self, gateways: set[str]) -> None:
        for rid in [rid for rid, run in self._running.items() if run.req.reply_to in gateways]:
            self._running.pop(rid).done(RuntimeError(f"{rid}: its gateway is gone"))


class FakeWorker:
    """The actor: what the colocated gateway backend asks of a worker, answered by a `FakeEngine`."""

    def __init__(self, worker_name: str, step_ms: float = 0.0, cluster_secret: ClusterSecret | None = None) -> None:
        if cluster_secret is not None:  # the publisher signs with the process's default, as a real worker's
            auth.set_default_secret(cluster_secret)
        self.name = worker_name
        self.engine = FakeEngine(worker_name, step_ms / 1e3)
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        # The real inbox (requests start there, as on a real worker), over this fake's `serve`.
        self.inbox = WorkerInbox(self._run_try, self.engine.abort, auth.resolve(cluster_secret), "127.0.0.1",
                                 self.incarnation)

    async def info(self) -> WorkerInfo:
        return WorkerInfo(num_kv_blocks=1 << 20, max_model_len=MAX_MODEL_LEN, dtype="fake", pid=os.getpid(),
                          inbox=self.inbox.open(), incarnation=self.incarnation)

    async def outcomes(self, gateway: str, after: int, timeout_s: float) -> Outcomes:
        return await self.inbox.outcomes(gateway, after, timeout_s)

    async def _run_try(self, start: StartTry) -> None:
        await self.serve(start.request)

    async def serve(self, req: ServeRequest) -> None:
        """Stream `req`'s tokens to its `reply_to`; return once its final delta is sent."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if ended.done():
                return
            if error is not None:
                ended.set_exception(error)
            else:
                ended.set_result(None)

        def done(error: BaseException | None) -> None:  # on the fake engine thread
            loop.call_soon_threadsafe(settle, error)

        self.engine.submit(req, done)
        try:
            async with asyncio.timeout(req.timeout_s):
                await ended
        finally:
            if not ended.done():  # the caller left or the deadline passed: stop making its tokens
                self.engine.abort(req.request_id, req.attempt)

    async def abort(self, request_id: str, attempt: int | None = None) -> None:
        self.engine.abort(request_id, attempt)

    async def load(self, since: Any = None) -> LoadReport:
        """Its running count and the tokens it made (the stall watch's progress), and no
        prefix-cache events (it keeps no KV)."""
        snapshot = EngineSnapshot(running=self.engine.num_running, generation_tokens=self.engine.tokens)
        return LoadReport(snapshot, _no_events(self.name), self.incarnation)

    async def progress(self) -> Progress:
        return Progress(EngineSnapshot(running=self.engine.num_running, generation_tokens=self.engine.tokens),
                        self.incarnation)

    async def metrics(self) -> bytes:
        return b""

    async def drain_state(self) -> DrainState:
        n = self.engine.num_running
        return DrainState(n, n, 0, 0, len(asyncio.all_tasks()), threading.active_count(), 0, self.incarnation)

    async def counts(self) -> tuple[int, int]:
        """(steps, tokens) sent so far: what the benchmark checks its streams against."""
        return self.engine.steps, self.engine.tokens

    def close(self) -> None:
        self.inbox.close()
        with contextlib.suppress(RuntimeError):
            self.engine.close()


def _no_events(worker_id: str) -> KVEventBatch:
    """An empty snapshot of the prefix cache: a worker that keeps no event log ("") and caches nothing."""
    return KVEventBatch(worker_id=worker_id, log_id="", first_seq=0, next_seq=0, snapshot=True, events=())


FakeWorkerActor = ray.remote(FakeWorker)
