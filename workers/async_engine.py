"""An LLMEngine driven by its own thread, with an asyncio-facing API: the owner
of every request's `Lifecycle` in one worker.

The engine is single-threaded by design; this class owns the thread that steps
it and is the only code that touches it. A request here is a `Job`: its
lifecycle (state, deadline, exit hooks), where its outputs go (the caller's
queue, or a gateway's token stream), and what the worker's role does for it
after each step (`JobRole`: a prefill worker sends its KV). Jobs are opened on
the event loop and live on the engine thread. The job's lifecycle is the engine
request's own (`start(engine, life)` hands it over): the scheduler moves it as the
request goes through the engine's queues, and nothing here moves it. Every exit
(finish, abort, caller gone, deadline, peer or engine failure) goes through
`end_now` on the engine thread: the lifecycle's exit hooks free the request's
blocks (and whatever its role registered), and the caller's wait ends with the
final output or an exception.

    open(...)  ->  begin(job, start)  ->  outputs(job) / finished(job)
    (event loop)   (engine thread: start(engine, job.life) queues the request)
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from pdserve.workers import row_faults
from pdserve.workers.engine import GRAMMAR_COMPILE_TIMEOUT_S, LLMEngine, too_slow
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.lifecycle import Exit, Lifecycle, LifecycleError, RequestState
from pdserve.workers.outputs import RequestOutput, merge_deltas
from pdserve.workers.sampling_params import RequestOutputKind, SamplingParams
from pdserve.workers.stats_log import StatsLog
from pdserve.workers.thread_names import name_os_thread
from pdserve.workers.token_stream import GATEWAY_GONE_S, StreamLostError, TokenStreamPublisher

T = TypeVar("T")
# Puts a job's request into the engine (on the engine thread), handing it the job's
# lifecycle; may return a first output.
Start = Callable[[LLMEngine, Lifecycle], RequestOutput | None]
ENGINE_THREAD_NAME = "pdserve-engine"
_GONE_CHECK_S = 0.5  # how often the engine thread looks at its gateway links (seconds)


class EngineDeadError(RuntimeError):
    """The engine thread failed; every in-flight request fails with this."""


class RequestFaultError(RuntimeError):
    """The engine failed this request alone: its values or logits broke its row of a
    step (workers/row_faults.py), and the batch went on without it. Not the worker's
    failure: the gateway does not move it to another worker (it would only fail there
    too: the poison-pill rule)."""


class RequestTimeoutError(TimeoutError):
    """A request passed its deadline; it was aborted and its blocks freed."""


class RequestAbortedError(RuntimeError):
    """Someone else aborted the request (the gateway, or the decode worker it served)."""


class WorkerDrainingError(RuntimeError):
    """This worker takes no more work of its role (it is changing role), or it cut the
    request short at the end of its drain. Not the request's fault: the gateway moves
    it to another worker from what its client already has (cluster/token_streams.py: RETRYABLE)."""


class JobRole(Protocol):
    """What a worker's role does for one of its jobs on the engine thread (a prefill
    worker's KV handoff): it takes the job's outputs, which go neither to the caller
    nor to a stream (the final one does not end the job: the role ends it), and it
    acts after every step while the job lives."""

    def take_output(self, out: RequestOutput) -> None: ...

    def after_step(self, engine: LLMEngine) -> None: ...


@dataclass(eq=False)
class Job:
    """One request in this worker: its lifecycle and where its outputs go."""

    life: Lifecycle
    loop: asyncio.AbstractEventLoop
    # The caller's side: outputs (or, with `reply_to`, only the final one) and the error that ended it.
    inbox: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    reply_to: str | None = None  # a gateway's token stream: deltas go there, batched per step
    tokens_sent: int = 0  # output tokens already on that stream (a delta's offset)
    attempt: int = 0  # the request's try (ServeRequest.attempt), stamped on its deltas
    # Engine thread: its request went into the engine. Until then, outputs under its
    # id are an earlier try's (still ending here after this one replaced it).
    started: bool = False
    role: JobRole | None = None  # engine thread: takes its outputs and acts after each step
    # Set (any thread) when an exit was asked for: work still queued for the engine
    # thread (starting it, reserving its blocks) is skipped rather than done and undone.
    ending: Exit | None = None

    @property
    def request_id(self) -> str:
        return self.life.request_id


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.002, worker_id: str = "engine") -> None:
        self.engine = engine
        self.worker_id = worker_id
        self._publisher: TokenStreamPublisher | None = None  # engine thread only
        self._published_final: list[Job] = []  # engine thread only
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self._calls: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = set()  # `call`s not answered
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # Engine thread, once per loop iteration, between taking commands and the
        # step (tests hold the thread with it to catch a request in a given state).
        self.on_iteration: Callable[[], None] | None = None
        # Called once (on the engine thread) after the engine thread failed and every
        # request heard of it: a worker process exits there, so that it is restarted
        # instead of living on as a zombie that answers calls but runs nothing.
        self.on_dead: Callable[[BaseException], None] | None = None
        # A gateway unreachable this long is gone: its requests here are aborted.
        self.gateway_gone_s = GATEWAY_GONE_S
        self.num_orphans_aborted = 0  # requests aborted because their gateway was gone
        # Set while the worker drains (a role switch): why `open` refuses new requests.
        self._refusing: str | None = None
        self._next_gone_check = 0.0  # engine thread: when to look at the gateway links again
        # The worker's stats line in its log (engine thread, once per loop iteration).
        self._stats_log = None if engine.config.disable_log_stats else StatsLog(worker_id)
        # The engine thread sets this itself: OpenMP's thread count is per thread, and a
        # new thread starts from OMP_NUM_THREADS (Ray sets it to 1 in every worker process),
        # not from what `torch.set_num_threads` set in the thread that built the engine.
        # Without this, a served worker ran its model on one core whatever it was given.
        # The count is the engine's share, which it compiled its graphs for.
        self.torch_threads = engine.torch_threads
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)

    # -- lifetime ---------------------------------------------------------------

    def start(self) -> AsyncEngine:
        """Start the engine thread (once); returns self."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread; requests still in flight fail with EngineDeadError."""
        if not self._thread.is_alive():  # never started, or died (a broken tensor-parallel group): no step runs
            self._stop.set()
            self.engine.close()
            return
        closed = EngineDeadError("engine closed")
        if self.error is None:
            # Before the jobs are failed: a request opened after `_fail_all` walked them, while the
            # thread still ran, was taken (healthy) and never ended (its start never ran): it
            # waited out its deadline. `open` checks `error` once its job is in, as for a death.
            self.error = closed
        self._commands.put(lambda: self._fail_all(closed))
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()  # its tensor-parallel ranks, once no step can run

    def __enter__(self) -> AsyncEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    # -- requests, for callers on the event loop ----------------------------------------

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       timeout_s: float = 600.0) -> AsyncGenerator[RequestOutput, None]:
        """Run a request; yield its DELTA outputs until it finishes. Bad input raises
        ValueError before anything is queued; see `outputs` for the rest."""
        await self.grammar_ready(params)
        self.engine.validate(prompt, params, grammar=False)
        params = params.with_output_kind(RequestOutputKind.DELTA)
        job = self.open(request_id, timeout_s)
        self.begin(job, lambda e, life: e.add_request(request_id, prompt, params, life=life))
        async with contextlib.aclosing(self.outputs(job)) as outputs:
            async for out in outputs:
                yield out

    async def serve(self, req: ServeRequest) -> None:
        """Run a request with its deltas going to the gateway's token stream at
        `req.reply_to`; return once its final delta is sent. See `finished`."""
        params = req.params.with_output_kind(RequestOutputKind.DELTA)
        await self.grammar_ready(params)
        self.engine.validate(list(req.prompt_token_ids), params, grammar=False)
        job = self.open_stream(req)
        self.begin(job, lambda e, life: e.add_request(req.request_id, list(req.prompt_token_ids), params,
                                                      resume=req.resume, life=life))
        await self.finished(job)

    async def grammar_ready(self, params: SamplingParams) -> None:
        """Wait, off the event loop's thread, for the request's grammar to compile (cached:
        at once); ValueError when it does not (naming the field), or not in time."""
        if params.constraint is None:
            return
        # The compiler itself is made off the loop too: the first one reads the tokenizer's whole
        # vocabulary (~0.14 s for 49k tokens), which stalled every request this loop serves.
        compiler = await asyncio.to_thread(self.engine.grammar_compiler)
        try:
            await compiler.ready(params.constraint, GRAMMAR_COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(too_slow(params)) from None

    def open_stream(self, req: ServeRequest, state: RequestState = RequestState.QUEUED) -> Job:
        """`open` a request whose deltas go to its gateway's token stream, after the
        tokens its client already has (a migrated request's)."""
        job = self.open(req.request_id, req.timeout_s, state, reply_to=req.reply_to, attempt=req.attempt)
        job.tokens_sent = req.offset
        if req.reply_to is not None:
            address = req.reply_to
            self._commands.put(lambda: self._watch(job, address))
        return job

    def _watch(self, job: Job, address: str) -> None:
        """Engine thread: connect the job's gateway now. An address ZeroMQ refuses fails
        this one request (it raised out of the command queue and ended the engine)."""
        try:
            self._stream().watch(address)
        except Exception as e:  # noqa: BLE001 - zmq.ZMQError, chiefly; one request's, not the engine's
            self.end_now(job, Exit.FAULT, RequestFaultError(f"request {job.request_id}: reply_to {address!r}: {e}"))

    def open(self, request_id: str, timeout_s: float, state: RequestState = RequestState.QUEUED,
             reply_to: str | None = None, attempt: int = 0) -> Job:
        """Track a new request here (before anything reaches the engine). Its first
        exit hook ends it in the engine: aborted (blocks freed) unless it finished,
        then released (a held prefill's blocks). EngineDeadError if the engine is down.
        A later try (`attempt`) of a request whose earlier try is still here ends
        that one first (the gateway gave up on it); the same try twice is a ValueError."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        if self._refusing is not None:
            raise WorkerDrainingError(f"request {request_id}: {self._refusing}")
        old = self._jobs.get(request_id)
        if old is not None:
            if old.attempt >= attempt:
                raise ValueError(f"request_id: {request_id!r} is already running here")
            # Queued before this job's start: the engine thread ends the old try first.
            self.end(old, Exit.ABORTED, RequestAbortedError(f"request {request_id}: superseded by try {attempt}"))
        job = Job(Lifecycle.start(request_id, timeout_s, state), asyncio.get_running_loop(), reply_to=reply_to,
                  attempt=attempt)
        job.life.on_exit(lambda exit: self._leave_engine(request_id, exit))
        self._jobs[request_id] = job
        if self.error is not None:
            # The engine died after the check above, and `_fail_all` may have walked the jobs
            # before this one was in them: no one would end it. (It sets `error` first, so a job
            # it did not see is one that sees `error` here.)
            del self._jobs[request_id]
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return job

    def begin(self, job: Job, start: Start) -> None:
        """Run `start(engine, job.life)` on the engine thread: it puts the request into
        the engine with the job's lifecycle (and may return a first output). A
        ValueError ends the job (REJECTED)."""
        self._commands.put(lambda: self._start(job, start))

    async def outputs(self, job: Job) -> AsyncGenerator[RequestOutput, None]:
        """The job's outputs until the final one. Raises RequestTimeoutError at its
        deadline, the error that ended it otherwise; leaving early aborts it."""
        try:
            while True:
                item = await self._next(job)
                # A consumer that fell behind gets everything pending as one delta.
                while not item.finished and not job.inbox.empty():
                    nxt = job.inbox.get_nowait()
                    if isinstance(nxt, BaseException):
                        job.inbox.put_nowait(nxt)  # raised on the next turn, after this delta
                        break
                    item = merge_deltas(item, nxt)
                yield item
                if item.finished:
                    return
        finally:
            self.end(job, Exit.ABORTED)  # nothing if it already ended

    async def finished(self, job: Job) -> RequestOutput:
        """Wait for the job's final output: with `reply_to` (or a `role`), the
        notice that its last delta went out (that its role ended it). Same exits
        as `outputs`."""
        done = False
        try:
            while True:
                item = await self._next(job)
                if item.finished:
                    done = True
                    return item
        finally:
            if not done:
                self.end(job, Exit.ABORTED)

    def end(self, job: Job, exit: Exit, error: BaseException | None = None) -> None:
        """End the job on the engine thread (from any thread); nothing if it already ended."""
        if not job.life.ended:
            job.ending = job.ending or exit
            self._commands.put(lambda: self.end_now(job, exit, error))

    async def end_and_wait(self, job: Job, exit: Exit, error: BaseException | None = None,
                           timeout_s: float = 5.0) -> None:
        """`end`, then wait (at most `timeout_s`: a stuck engine thread must not hold the
        caller) until the engine thread has run it: the request's blocks are free when
        this returns, before its caller hears why it ended."""
        self.end(job, exit, error)
        with contextlib.suppress(TimeoutError, EngineDeadError):
            await self.call(lambda e: None, timeout_s=timeout_s)

    def answer(self, job: Job, final: RequestOutput) -> None:
        """Hand the job's caller `final` now (any thread); the job itself still ends
        on the engine thread (`end_now` without a final), soon after."""
        _on_loop(job.loop, job.inbox.put_nowait, final)

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn()` on the engine thread, soon (from any thread; does not wait)."""
        self._commands.put(fn)

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Abort a request from outside (the gateway's or a peer's abort); unknown ids
        are ignored. With `attempt`, only that try or an earlier one: an abort of a
        given-up try that arrives late must not end the try that replaced it here."""
        job = self._jobs.get(request_id)
        if job is not None and (attempt is None or job.attempt <= attempt):
            self.end(job, Exit.ABORTED, RequestAbortedError(f"request {request_id} was aborted"))

    def job(self, request_id: str) -> Job | None:
        return self._jobs.get(request_id)

    # -- draining (a role switch) ---------------------------------------------------------

    def refuse_new(self, reason: str | None) -> None:
        """From now on `open` raises WorkerDrainingError(`reason`); None takes requests again.
        Requests already here go on."""
        self._refusing = reason

    async def end_all(self, error: BaseException, timeout_s: float = 5.0) -> int:
        """End every request here now (ABORTED, their callers hear `error`); how many.
        Returns once the engine thread has run their exits (their blocks are free), or
        after `timeout_s` (a stuck engine thread must not hold the caller)."""
        jobs = self._live_jobs()
        for job in jobs:
            self.end(job, Exit.ABORTED, error)
        with contextlib.suppress(TimeoutError, EngineDeadError):
            await self.call(lambda e: None, timeout_s=timeout_s)
        return len(jobs)

    async def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        """Run `fn(engine)` on the engine thread and return its result. EngineDeadError
        if the engine is not running; TimeoutError if the thread does not get to it in time."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        pending = (loop, fut)

        def run() -> None:
            self._calls.discard(pending)
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                _on_loop(loop, _settle, fut, None, e)
            else:
                _on_loop(loop, _settle, fut, result, None)

        self._calls.add(pending)
        self._commands.put(run)
        if self.error is not None:  # died since the check above: `run` may never run (as in `open`)
            self._calls.discard(pending)
            fut.cancel()  # a late settle of it finds it done
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        finally:
            self._calls.discard(pending)

    async def _next(self, job: Job) -> RequestOutput:
        try:
            async with asyncio.timeout(job.life.remaining()):
                item = await job.inbox.get()
        except TimeoutError:
            self.end(job, Exit.DEADLINE)
            raise RequestTimeoutError(f"request {job.request_id} passed its deadline here") from None
        if isinstance(item, BaseException):
            raise item
        return item

    # -- engine thread ------------------------------------------------------------------

    def _leave_engine(self, request_id: str, exit: Exit) -> None:
        if exit is Exit.FINISHED:
            self.engine.release(request_id)  # a held prefill's blocks; nothing for others
        else:
            # The job's exit tells its caller; an "abort" output from the engine would
            # reach whatever job holds the id next (a later try of the request).
            self.engine.abort(request_id, output=False)

    def _start(self, job: Job, start: Start) -> None:
        if job.life.ended or job.ending is not None:
            return  # its exit is already on the way (the caller went away, an abort)
        if job.life.remaining() <= 0:
            self.end_now(job, Exit.DEADLINE, RequestTimeoutError(f"request {job.request_id} passed its deadline"))
            return
        job.started = True
        try:
            first = start(self.engine, job.life)
        except ValueError as e:
            self.end_now(job, Exit.REJECTED, e)
            return
        except Exception as e:  # noqa: BLE001 - one request's input must not end the engine thread
            self.end_now(job, Exit.FAULT, RequestFaultError(f"request {job.request_id}: {row_faults.describe(e)}"))
            return
        if self.engine.lifecycle_of(job.request_id) not in (job.life, None):
            raise LifecycleError(f"request {job.request_id}: started without its job's lifecycle")
        if first is not None:
            self._deliver(first)

    def end_now(self, job: Job, exit: Exit, error: BaseException | None = None,
                final: RequestOutput | None = None) -> None:
        """Engine thread: the one exit. The lifecycle runs its hooks (the request's
        blocks are freed, with whatever its role took), then the caller hears:
        `final` (FINISHED) or the error. Nothing if the job had already ended."""
        if not job.life.end(exit):
            return
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        if exit is not Exit.FINISHED:
            failure = error or RequestAbortedError(f"request {job.request_id} ended: {exit.value}")
            _on_loop(job.loop, job.inbox.put_nowait, failure)
        elif final is not None:
            _on_loop(job.loop, job.inbox.put_nowait, final)

    def _fail_all(self, error: BaseException) -> None:
        for job in self._live_jobs():
            self.end_now(job, Exit.ENGINE_FAILED, error)
        for loop, fut in list(self._calls):  # a call still queued will never run now
            _on_loop(loop, _settle, fut, None, error)

    def _run(self) -> None:
        name_os_thread("pd-engine")
        torch.set_num_threads(self.torch_threads)
        try:
            idle = True
            while not self._stop.is_set():
                # Block for commands when there is nothing to step, or when the last
                # step could schedule nothing (requests waiting only for their KV, or
                # for blocks): spinning here would hold the GIL that the transfer
                # thread and the event loop need.
                self._drain_commands(block=idle)
                if self.on_iteration is not None:
                    self.on_iteration()
                    self._drain_commands(block=False)  # what came while it held the thread
                # What the commands published (a prefill's first token, once its KV is
                # verified) goes out now, not after the step: a step can be long.
                self._flush_remote()
                idle = not self._step()
                if self._stats_log is not None:
                    self._stats_log.tick(self.engine)
                for job in self._live_jobs():
                    # Not before its start ran: until then what the engine holds under its id is
                    # an earlier try's (as `_deliver` knows), and its role would act on that.
                    if job.role is not None and job.started:
                        self._after_step(job, job.role)
                self._flush_remote()
            # Stopped (close): close() queued the failing of every job, but a thread that saw the
            # stop on its way back from a step left without running what was queued, and the jobs
            # in flight waited out their deadlines. Their end is this thread's last act.
            self._fail_all(self.error or EngineDeadError("engine closed"))
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self.error = e
            self._fail_all(EngineDeadError(f"engine failed: {e!r}"))
            if self.on_dead is not None:
                self.on_dead(e)
        finally:
            if self._publisher is not None:
                self._publisher.close()
            if self._stop.is_set():
                # Closed while a step ran past close()'s wait: close() left the engine to this thread,
                # now that no step runs (its tensor-parallel ranks would run on, holding the process's
                # one group). Idempotent: close() may have closed it too.
                self.engine.close()

    def _live_jobs(self) -> list[Job]:
        """A copy of the jobs: the event loop opens new ones while this thread walks them
        (`list()` of a dict's values takes them in one step, under the GIL)."""
        return list(self._jobs.values())

    def _step(self) -> bool:
        """One engine step, its outputs delivered; whether it ran the model (or landed a step
        in flight: async scheduling, whose outputs come a step late)."""
        if not self.engine.has_unfinished_requests():
            self.engine.cpu_idle()  # e.g. its last request was aborted between steps
            return False
        steps, landed = self.engine.stats.steps, self.engine.in_flight
        for out in self.engine.step():
            self._deliver(out)
        return self.engine.stats.steps != steps or landed

    def _after_step(self, job: Job, role: JobRole) -> None:
        try:
            role.after_step(self.engine)
        except Exception as e:  # noqa: BLE001 - one request's handoff must not end the engine thread
            self.end_now(job, Exit.FAULT, RequestFaultError(f"request {job.request_id}: {row_faults.describe(e)}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s * 50) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        job = self._jobs.get(out.request_id)
        if job is None or not job.started:
            return  # it ended here already (aborted, the caller left, a later try replaced it)
        if out.error is not None:  # the engine failed it alone; its blocks are free already
            if out.error_refused:
                self.end_now(job, Exit.REJECTED, ValueError(out.error))
            else:
                self.end_now(job, Exit.FAULT, RequestFaultError(f"request {job.request_id} failed: {out.error}"))
            return
        if job.role is not None:
            job.role.take_output(out)
            return
        if job.reply_to is None:
            _on_loop(job.loop, job.inbox.put_nowait, out)
            if out.finished:
                self.end_now(job, Exit.FINISHED)
            return
        self.publish(job, out)
        if out.finished:  # the caller hears of it once the delta is sent
            self._published_final.append(job)

    def publish(self, job: Job, out: RequestOutput) -> None:
        """Engine thread: put a delta of `job` on its gateway's token stream (sent at
        the end of this loop iteration)."""
        assert job.reply_to is not None, f"request {job.request_id} has no token stream"
        self._stream().add(job.reply_to, out, job.tokens_sent, job.attempt)
        job.tokens_sent += len(out.outputs[0].token_ids)

    def _stream(self) -> TokenStreamPublisher:
        """Engine thread: the publisher of this worker's token streams."""
        if self._publisher is None:
            self._publisher = TokenStreamPublisher(self.worker_id)
        return self._publisher

    def _flush_remote(self) -> None:
        """Send this iteration's token deltas, then end the jobs whose final delta went
        out, and those whose gateway is gone."""
        if self._publisher is None:
            return
        for rid in self._publisher.flush():
            job = self._jobs.get(rid)
            if job is not None:
                self.end_now(job, Exit.PEER_FAILED, StreamLostError(f"{rid}: its gateway stopped reading tokens"))
        finished, self._published_final = self._published_final, []
        for job in finished:
            self.end_now(job, Exit.FINISHED, final=done_notice(job.request_id))
        now = time.monotonic()
        if now >= self._next_gone_check:
            self._next_gone_check = now + _GONE_CHECK_S
            gone = self._publisher.gone(self.gateway_gone_s)
            for job in [j for j in self._live_jobs() if j.reply_to in gone]:
                self.num_orphans_aborted += 1
                self.end_now(job, Exit.PEER_FAILED, StreamLostError(f"{job.request_id}: its gateway is gone"))


def done_notice(request_id: str) -> RequestOutput:
    """What `finished` returns when the real final output went elsewhere (a token stream)."""
    return RequestOutput(request_id, None, [], [], finished=True)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """Hand `fn(*args)` to a caller's event loop; nothing if that loop is gone (its
    caller left, a test or a process shutting down): the engine thread goes on."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


def _settle(fut: asyncio.Future[T], value: T | None, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)  # type: ignore[arg-type]  # T when exc is None
