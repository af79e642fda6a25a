"""Every exit of every state of a request's lifecycle (workers/lifecycle.py;
docs/lifecycle.md has the table this walks), on each kind of process: whatever
the exit, the request leaves from that state, its blocks are freed on both
workers, nothing of it is left in the engines or the KV receiver, and its
client gets a terminal event (its final output, or an error).

A case holds the request in its state by holding the engine thread of the
worker that owns it (`Gate`), triggers the exit, lets go, and checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from factories import LocalPrefillPeer, tiny_spec
from faults import Faults

from pdserve import LLM, SamplingParams
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.async_engine import AsyncEngine, EngineDeadError, Job, RequestAbortedError
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import KVFailurePolicy, ServeRequest
from pdserve.workers.lifecycle import NEXT, Exit, Lifecycle, LifecycleError, RequestState
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.token_stream import StreamLostError, TokenStreamPublisher
from pdserve.workers.transfer.base import TransferError
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

S = RequestState
PROMPT = list(range(7, 7 + 60))  # 4 blocks, prefilled in chunks of 16: several steps in PREFILLING
TIMEOUT_S = 1.5  # a case's request timeout when its exit is the deadline
PREFILL_TIMEOUT_S = 1.0  # what the decode worker gives a remote prefill


def test_the_machine_refuses_moves_it_does_not_have_and_ends_once() -> None:
    life = Lifecycle.start("r", 5.0)
    with pytest.raises(LifecycleError):
        life.move(S.TRANSFERRING)  # QUEUED -> TRANSFERRING is no move
    freed: list[Exit] = []

    def broken(exit: Exit) -> None:
        raise RuntimeError("a broken hook")

    life.on_exit(freed.append)
    life.on_exit(broken)
    life.move(S.PREFILLING)
    assert life.end(Exit.DEADLINE) and not life.end(Exit.FINISHED)  # the first exit wins
    assert freed == [Exit.DEADLINE]  # the hook before the broken one still ran
    assert life.state is S.FAILED and life.history == [S.QUEUED, S.PREFILLING, S.FAILED]
    with pytest.raises(LifecycleError):
        life.on_exit(freed.append)
    assert all(not NEXT[s] for s in (S.FINISHED, S.ABORTED, S.FAILED))


# -- the cases --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    role: str  # the process that owns the request in `state`: colocated | prefill | decode
    state: RequestState
    exit: Exit
    client: type[BaseException] | None  # what the client gets (None: the whole output)
    fault: str | None = None  # corrupt | end_delay | end_drop: in the KV transfer
    policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE

    @property
    def id(self) -> str:
        return f"{self.role}-{self.state.value}-{self.exit.value}"


FAIL = KVFailurePolicy.FAIL
CASES = [
    Case("colocated", S.QUEUED, Exit.ABORTED, RequestAbortedError),
    Case("colocated", S.QUEUED, Exit.DEADLINE, TimeoutError),
    Case("colocated", S.QUEUED, Exit.ENGINE_FAILED, EngineDeadError),
    Case("colocated", S.QUEUED, Exit.REJECTED, ValueError),
    Case("colocated", S.PREFILLING, Exit.ABORTED, RequestAbortedError),
    Case("colocated", S.PREFILLING, Exit.DEADLINE, TimeoutError),
    Case("colocated", S.PREFILLING, Exit.ENGINE_FAILED, EngineDeadError),
    Case("colocated", S.DECODING, Exit.FINISHED, None),
    Case("colocated", S.DECODING, Exit.ABORTED, RequestAbortedError),
    Case("colocated", S.DECODING, Exit.DEADLINE, TimeoutError),
    Case("colocated", S.DECODING, Exit.ENGINE_FAILED, EngineDeadError),
    # The prefill worker's failures are not the client's: the decode worker recomputes.
    Case("prefill", S.QUEUED, Exit.ABORTED, RequestAbortedError),
    Case("prefill", S.QUEUED, Exit.DEADLINE, None),
    Case("prefill", S.QUEUED, Exit.ENGINE_FAILED, None),
    Case("prefill", S.PREFILLING, Exit.ABORTED, RequestAbortedError),
    Case("prefill", S.PREFILLING, Exit.DEADLINE, None),
    Case("prefill", S.PREFILLING, Exit.PEER_FAILED, None, fault="corrupt"),
    Case("prefill", S.PREFILLING, Exit.ENGINE_FAILED, None),
    Case("prefill", S.TRANSFERRING, Exit.FINISHED, None, fault="end_delay"),
    Case("prefill", S.TRANSFERRING, Exit.PEER_FAILED, None, fault="end_drop"),
    Case("decode", S.ROUTED, Exit.ABORTED, RequestAbortedError),
    Case("decode", S.ROUTED, Exit.DEADLINE, TimeoutError),
    Case("decode", S.ROUTED, Exit.ENGINE_FAILED, EngineDeadError),
    Case("decode", S.TRANSFERRING, Exit.ABORTED, RequestAbortedError),
    Case("decode", S.TRANSFERRING, Exit.DEADLINE, TimeoutError),
    Case("decode", S.TRANSFERRING, Exit.PEER_FAILED, TransferError, fault="corrupt", policy=FAIL),
    Case("decode", S.TRANSFERRING, Exit.ENGINE_FAILED, EngineDeadError),
    Case("decode", S.QUEUED, Exit.ABORTED, RequestAbortedError, fault="corrupt"),
    Case("decode", S.QUEUED, Exit.DEADLINE, TimeoutError, fault="corrupt"),
    Case("decode", S.DECODING, Exit.FINISHED, None),
    Case("decode", S.DECODING, Exit.ABORTED, RequestAbortedError),
    Case("decode", S.DECODING, Exit.DEADLINE, TimeoutError),
    Case("decode", S.DECODING, Exit.ENGINE_FAILED, EngineDeadError),
]


@dataclass
class Cluster:
    """A prefill and a decode worker in this process (in-process KV transport);
    every lifecycle either opens is kept in `lives`."""

    prefill: PrefillWorker
    decode: DecodeWorker
    receiver: InProcessReceiver
    lives: dict[str, dict[str, Lifecycle]]

    def owner(self, role: str) -> PrefillWorker | DecodeWorker:
        return self.prefill if role == "prefill" else self.decode


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture
def cluster(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    case: Case = request.param

    def engine() -> Any:
        return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16,
                   progress=False).engine

    faults = Faults()
    if case.fault == "corrupt":
        faults.corrupt(layer=0)
    elif case.fault == "end_delay":
        faults.delay(0.5, end_marker=True)
    elif case.fault == "end_drop":
        faults.drop(end_marker=True)
    p_engine, d_engine = engine(), engine()
    receiver = InProcessReceiver(d_engine.kv_caches)
    sender = InProcessSender(p_engine.kv_caches, receiver, faults)
    # A decode worker's deadline in TRANSFERRING must pass while it waits for the
    # prefill worker: give the remote prefill all its time in that case.
    # The held end marker's case is about finishing late, not about the lease: its budget covers a
    # first step's compile on a slow machine too (1 s did not, on a 2-core Sapphire Rapids VM).
    budget = None if (case.role, case.state, case.exit) == ("decode", S.TRANSFERRING, Exit.DEADLINE) \
        else 20.0 if case.fault == "end_delay" else PREFILL_TIMEOUT_S
    c = Cluster(PrefillWorker(p_engine, lambda address: sender).start(),
                DecodeWorker(d_engine, receiver, case.policy, prefill_timeout_s=budget).start(),
                receiver, {"prefill": {}, "decode": {}})
    for role in ("prefill", "decode"):
        _record_lives(c.owner(role).async_engine, c.lives[role])
    yield c
    c.prefill.close()
    c.decode.close()


def _record_lives(ae: AsyncEngine, into: dict[str, Lifecycle]) -> None:
    opened = ae.open

    def open_and_record(*args: Any, **kwargs: Any) -> Job:
        job = opened(*args, **kwargs)
        into[job.request_id] = job.life
        return job

    ae.open = open_and_record  # type: ignore[method-assign]


@pytest.mark.parametrize("cluster", CASES, ids=[c.id for c in CASES], indirect=True)
def test_every_exit_of_every_state_frees_everything_and_ends_the_stream(cluster: Cluster, request: Any) -> None:
    case: Case = request.node.callspec.params["cluster"]
    result = asyncio.run(_run(case, cluster))
    if case.client is None:
        assert isinstance(result, list) and result[-1].finished, result
        assert [t for o in result for t in o.outputs[0].token_ids] == _expected(cluster)
    else:
        assert isinstance(result, case.client), f"the client got {result!r}, not {case.client.__name__}"
    life = cluster.lives["prefill" if case.role == "prefill" else "decode"][case.id]
    assert life.exit is case.exit and life.history[-2] is case.state, (life.exit, life.history)
    for role in ("prefill", "decode"):
        assert all(lv.ended for lv in cluster.lives[role].values()), role
        worker = cluster.owner(role)
        e = worker.engine
        assert e.kv.pool.num_used == 0, f"the {role} worker holds {e.kv.pool.num_used} blocks"
        assert not e.scheduler.requests and not e.has_unfinished_requests()
        assert worker.async_engine.num_in_flight == 0
    assert not cluster.receiver.num_registered, "a KV registration was left behind"


def _expected(cluster: Cluster) -> list[int]:
    out = LLM.from_config(cluster.decode.engine.config).generate([PROMPT], _params())[0]
    return out.outputs[0].token_ids


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# -- driving one case ------------------------------------------------------------------


class Gate:
    """Holds an engine thread (which calls it) once `when()` holds, until `go` is
    set; with `fail`, the thread then dies there. `ready()` (checked by the test,
    on its loop) says the request is where the case wants it."""

    def __init__(self, when: Callable[[], bool], fail: bool = False,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.when, self.fail, self.ready = when, fail, ready
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self) -> None:
        if self.reached.is_set() or not self.when():
            return
        self.reached.set()
        assert self.go.wait(30), "a gate was never released"
        if self.fail:
            raise RuntimeError("the engine thread died (test)")

    async def wait(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.reached.is_set() and self.ready()):
            assert time.monotonic() < deadline, "the request never reached its state"
            await asyncio.sleep(0.002)


def watch(when: Callable[[], bool]) -> Gate:
    """A gate no thread calls: the test only waits until `when()` holds (a state
    the owning thread is busy in, and cannot be held in)."""
    gate = Gate(when)
    gate.reached.set()
    gate.ready = when
    return gate


async def _run(case: Case, c: Cluster) -> list[RequestOutput] | BaseException:
    timeout = TIMEOUT_S if case.exit is Exit.DEADLINE and case.role != "prefill" else 20.0
    collector = TokenStreamCollector()
    prompt = [10**9] if case.exit is Exit.REJECTED else PROMPT  # not in the vocabulary
    req = ServeRequest(case.id, tuple(prompt), _params(), timeout, collector.address)
    gate = _gate(case, c)
    # The client waits a little longer than the worker: the worker's own deadline is what the case tests.
    collector.open(req.request_id, list(req.prompt_token_ids), req.timeout_s + 1.0)
    if case.role == "colocated":
        call = c.decode.serve(req) if case.exit is not Exit.REJECTED else _refused(c.decode.async_engine, req)
    else:
        call = c.decode.handoff(req, LocalPrefillPeer(c.prefill))
    client = asyncio.ensure_future(_client(collector, req, call))
    try:
        if gate is not None:
            await gate.wait()
            await _trigger(case, c, req)
            gate.go.set()
        return await asyncio.wait_for(client, 30)
    finally:
        if gate is not None:
            gate.go.set()
        await _settle(c)
        await collector.close()


def _gate(case: Case, c: Cluster) -> Gate | None:
    """How the case holds its request in its state (None: its exit comes by itself)."""
    ae = c.owner(case.role).async_engine
    if (case.role, case.state, case.exit) == ("prefill", S.PREFILLING, Exit.PEER_FAILED):
        return _held_until_the_link_reports(case, c, ae)
    if case.exit in (Exit.REJECTED, Exit.PEER_FAILED) or case.exit is Exit.FINISHED and case.role == "prefill":
        if case.state is S.TRANSFERRING and case.role == "prefill":  # inside sender.finish
            return watch(lambda: _state(ae, case.id) is S.TRANSFERRING)
        return None
    if case.state is S.ROUTED:  # hold the thread first: the reservation waits behind it
        gate = Gate(lambda: True, fail=case.exit is Exit.ENGINE_FAILED)
        ae._commands.put(gate)
        return gate
    if case.state is S.TRANSFERRING:  # the decode worker waits for a prefill worker held at once
        gate = Gate(lambda: True, ready=lambda: (life := c.lives["decode"].get(case.id)) is not None
                    and life.state is S.TRANSFERRING)
        c.prefill.async_engine._commands.put(gate)
        return gate
    if case.state is S.QUEUED and case.role == "decode":  # back in its queue after the KV failed
        def when() -> bool:
            life = c.lives["decode"].get(case.id)
            return life is not None and life.state is S.QUEUED and S.TRANSFERRING in life.history
    else:
        def when() -> bool:
            return _state(ae, case.id) is case.state
    gate = Gate(when, fail=case.exit is Exit.ENGINE_FAILED)
    ae.on_iteration = gate
    return gate


def _held_until_the_link_reports(case: Case, c: Cluster, ae: AsyncEngine) -> Gate:
    """The link's thread reports the corrupt chunk while the engine thread prefills on: a fast
    engine could finish the prompt first (TRANSFERRING). Hold the engine thread after a second
    step in PREFILLING (the first chunk's blocks are on their way by then) until the report has
    come; the thread then takes it before its next step."""
    steps_seen = [0]

    def reported() -> bool:
        life, job = c.lives["prefill"].get(case.id), ae.job(case.id)
        return life is not None and (life.ended or (job is not None and job.ending is not None))

    def when() -> bool:
        steps_seen[0] += _state(ae, case.id) is S.PREFILLING
        return steps_seen[0] >= 2 or reported()

    gate = Gate(when, ready=reported)
    ae.on_iteration = gate
    return gate


def _state(ae: AsyncEngine, rid: str) -> RequestState | None:
    job = ae.job(rid)
    return job.life.state if job is not None else None


async def _trigger(case: Case, c: Cluster, req: ServeRequest) -> None:
    if case.state is S.ROUTED:  # let the decode worker open it, behind the held thread
        while c.lives["decode"].get(req.request_id) is None:
            await asyncio.sleep(0.002)
    if case.state is S.TRANSFERRING and case.exit is Exit.ENGINE_FAILED:  # while its prefill worker is held
        ae = c.decode.async_engine
        ae.post(_crash)
        while ae.healthy:
            await asyncio.sleep(0.002)
    if case.exit is Exit.ABORTED:  # the gateway's abort: both workers
        c.decode.abort(req.request_id)
        c.prefill.abort(req.request_id)
    elif case.exit is Exit.DEADLINE:  # held past it
        held = PREFILL_TIMEOUT_S if case.role == "prefill" else TIMEOUT_S
        await asyncio.sleep(held + 0.3)


def _crash() -> None:
    """Posted to an engine thread: it dies there, as a bug would end it."""
    raise RuntimeError("the engine thread died (test)")


async def _refused(ae: AsyncEngine, req: ServeRequest) -> None:
    """A request the engine refuses when it starts (a token id outside the vocabulary)."""
    job = ae.open(req.request_id, req.timeout_s, reply_to=req.reply_to)
    ae.begin(job, lambda e, life: e.add_request(req.request_id, list(req.prompt_token_ids), req.params, life=life))
    await ae.finished(job)


async def _client(collector: TokenStreamCollector, req: ServeRequest, call: Any) -> Any:
    """The client's side: every delta to the final one, or the error that ended it."""
    try:
        return [o async for o in collector.consume(req.request_id, collector.watch(req.request_id, call))]
    except Exception as e:  # noqa: BLE001 - the terminal event under test
        return e


async def _settle(c: Cluster) -> None:
    """Both engine threads have acted on what they were told (a barrier each)."""
    for worker in (c.prefill, c.decode):
        if worker.async_engine.healthy:
            await worker.async_engine.call(lambda e: None)


# -- the gateway's part --------------------------------------------------------------------


GATEWAY_CASES = [
    (S.ROUTED, Exit.ABORTED), (S.ROUTED, Exit.DEADLINE), (S.ROUTED, Exit.PEER_FAILED), (S.ROUTED, Exit.REJECTED),
    (S.DECODING, Exit.FINISHED), (S.DECODING, Exit.ABORTED), (S.DECODING, Exit.DEADLINE),
    (S.DECODING, Exit.PEER_FAILED),
]


@pytest.mark.parametrize(("state", "exit"), GATEWAY_CASES, ids=[f"{s.value}-{e.value}" for s, e in GATEWAY_CASES])
def test_the_gateways_lifecycle_ends_with_its_stream(state: RequestState, exit: Exit) -> None:
    """The gateway's side of a request (its token-stream collector) against a fake
    worker: every exit ends the lifecycle, runs its hooks (the backend's abort on
    the workers: on every exit but FINISHED) and ends the client's stream."""

    async def main() -> tuple[Lifecycle, list[Exit], BaseException | None]:
        collector = TokenStreamCollector(final_grace_s=0.2)
        pub = TokenStreamPublisher("w")
        life = collector.open("r", [1, 2, 3], 0.5 if exit is Exit.DEADLINE else 10.0)
        aborted: list[Exit] = []
        life.on_exit(lambda e: aborted.append(e) if e is not Exit.FINISHED else None)
        worker_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stream = collector.consume("r", collector.watch("r", worker_done))
        error: BaseException | None = None
        try:
            if state is S.DECODING:
                pub.add(collector.address, _delta("r", [5], exit is Exit.FINISHED), 0)
                pub.flush()
                await stream.__anext__()
            if exit is Exit.ABORTED:  # the client goes away while it waits for a token
                waiting = asyncio.ensure_future(stream.__anext__())
                await asyncio.sleep(0.05)
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
                await stream.aclose()
            else:
                if exit is Exit.REJECTED:
                    worker_done.set_exception(ValueError("prompt: too long"))
                elif exit is Exit.PEER_FAILED:
                    worker_done.set_result(None)  # the worker is done; its last delta never comes
                async for _ in stream:
                    pass
        except Exception as e:  # noqa: BLE001 - the terminal event under test
            error = e
        finally:
            pub.close()
            await collector.close()
        return life, aborted, error

    life, aborted, error = asyncio.run(main())
    assert life.exit is exit and life.history[-2] is state, life.history
    assert aborted == ([] if exit is Exit.FINISHED else [exit])
    expected = {Exit.FINISHED: None, Exit.ABORTED: None, Exit.DEADLINE: TimeoutError,
                Exit.PEER_FAILED: StreamLostError, Exit.REJECTED: ValueError}[exit]
    assert (error is None) if expected is None else isinstance(error, expected), error


def _delta(rid: str, tokens: list[int], final: bool) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, "x", tokens, finish_reason="length" if final
                                                                  else None)], final)


def test_a_caller_whose_event_loop_is_gone_does_not_take_the_engine_down(model_dir: Path) -> None:
    """The engine thread tells a caller its request ended on the caller's event loop;
    if that loop has closed meanwhile (the caller left, a process shutting down),
    the engine thread goes on."""
    ae = AsyncEngine(LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).engine).start()

    async def open_and_leave() -> Job:
        return ae.open("gone", 5.0)

    try:
        job = asyncio.run(open_and_leave())  # its loop is closed from here on
        ae.end(job, Exit.ABORTED)
        deadline = time.monotonic() + 5
        while ae.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ae.healthy and ae.num_in_flight == 0 and job.life.state is S.ABORTED
    finally:
        ae.close()


def test_a_caller_cancelled_as_its_next_output_arrives_stays_cancelled(model_dir: Path) -> None:
    """The gateway cancels a request's reader when its client leaves. If that cancel lands in
    the loop turn in which the next delta arrives (tokens come every step, so under load it
    often does), the reader must still end cancelled and the request aborted: Python 3.11's
    `asyncio.wait_for` returned the delta instead, and the request ran to its last token."""
    ae = AsyncEngine(LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).engine).start()

    async def main() -> tuple[bool, Job]:
        job = ae.open("r", 30.0)  # only the reader here: no engine request, the deltas are ours
        outputs = ae.outputs(job)
        reader = asyncio.create_task(anext(outputs))
        await asyncio.sleep(0.01)  # the reader waits for its next delta
        job.inbox.put_nowait(_delta("r", [7], final=False))
        reader.cancel()  # the same turn
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        cancelled = reader.cancelled()
        await outputs.aclose()
        return cancelled, job

    try:
        cancelled, job = asyncio.run(main())
        deadline = time.monotonic() + 5
        while ae.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled, "the cancel was swallowed: the reader got the delta"
        assert job.life.exit is Exit.ABORTED and ae.num_in_flight == 0
    finally:
        ae.close()


# -- the engine dying between a check and a registration ------------------------------------


def test_a_request_or_call_that_comes_as_the_engine_dies_hears_so_at_once(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`open` and `call` check that the engine runs, then register. Should it die between the
    two, after `_fail_all` walked the jobs and calls, no one would end the job or answer the
    call: each waited for its deadline (a 504, seconds to minutes later). Each raises
    EngineDeadError instead. The window is held open here by a check that passed."""
    ae = AsyncEngine(LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).engine).start()
    try:
        ae.post(_crash)
        deadline = time.monotonic() + 10
        while ae.error is None or ae._thread.is_alive():
            assert time.monotonic() < deadline, "the engine thread never died"
            time.sleep(0.005)
        monkeypatch.setattr(AsyncEngine, "healthy", property(lambda self: True))  # checked before the death

        async def main() -> None:
            with pytest.raises(EngineDeadError):
                ae.open("late", 30.0)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(ae.call(lambda e: None, timeout_s=30.0), 5)

        asyncio.run(main())
        assert ae.num_in_flight == 0
    finally:
        monkeypatch.undo()
        ae.close()
