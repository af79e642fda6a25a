"""Prefill worker -> KV transport -> decode worker, in one process (in-process
transport): outputs equal the offline engine's; a dropped or corrupted KV
message is detected, the request is re-prefilled (or fails, by policy), and no
block is left allocated on either side."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalPrefillPeer, handoff_deltas, tiny_spec
from faults import Faults

from pdserve import LLM, SamplingParams
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.async_engine import EngineDeadError, RequestFaultError
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import KVFailurePolicy, ServeRequest
from pdserve.workers.lifecycle import Exit
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer.base import FailReason, TransferError
from pdserve.workers.transfer.frames import CacheGeometry
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


_live: list[PrefillWorker | DecodeWorker] = []


@pytest.fixture(autouse=True)
def _close_workers() -> Iterator[None]:
    yield
    while _live:
        _live.pop().close()


def make_pair(model_dir: Path, policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE, faults: Faults | None = None,
              chunk: int = 32, **engine_kw: Any) -> tuple[PrefillWorker, DecodeWorker]:
    def engine():  # noqa: ANN202
        return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=chunk,
                   progress=False, **engine_kw).engine

    p_engine, d_engine = engine(), engine()
    receiver = InProcessReceiver(d_engine.kv_caches)
    sender = InProcessSender(p_engine.kv_caches, receiver, faults)
    # A lost KV message shows only at the deadline: 2 s for the remote prefill leaves time to recompute.
    decode = DecodeWorker(d_engine, receiver, policy, prefill_timeout_s=2.0)
    pair = PrefillWorker(p_engine, lambda addr: sender).start(), decode.start()
    _live.extend(pair)
    return pair


async def serve_one(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int],
                    params: SamplingParams) -> list[int]:
    return [t for out in await handoff_deltas(p, d, rid, prompt, params) for t in out.outputs[0].token_ids]


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (length,), generator=g).tolist() for _ in range(n)]


def expected(model_dir: Path, ps: list[list[int]], params: SamplingParams, **engine_kw: Any) -> list[list[int]]:
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False, **engine_kw)
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


def assert_no_blocks(p: PrefillWorker, d: DecodeWorker) -> None:
    assert p.engine.kv.pool.num_used == 0 and d.engine.kv.pool.num_used == 0
    assert not p.engine.has_unfinished_requests() and not d.engine.has_unfinished_requests()


def test_disaggregated_greedy_equals_offline_with_chunked_streaming(model_dir: Path) -> None:
    ps = prompts(3, 70)  # 70 tokens in chunks of 32: KV leaves as each chunk completes
    p, d = make_pair(model_dir)

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(serve_one(p, d, f"r{i}", x, PARAMS) for i, x in enumerate(ps))))

    assert asyncio.run(main()) == expected(model_dir, ps, PARAMS)
    assert_no_blocks(p, d)


def test_an_fp8_kv_cache_crosses_as_fp8_and_decodes_as_offline(model_dir: Path) -> None:
    """--kv-cache-dtype fp8 on both workers: the blocks move as e4m3 bytes (one a value: half a
    16-bit cache's), and greedy decoding over them equals the offline engine with the same cache."""
    ps = prompts(3, 70, seed=7)
    p, d = make_pair(model_dir, kv_cache_dtype="fp8")
    geometry = CacheGeometry.of(p.engine.kv_caches)
    assert geometry.dtype_name == "float8_e4m3fn" == CacheGeometry.of(d.engine.kv_caches).dtype_name
    bs, heads, dim = geometry.block_shape
    assert geometry.block_bytes == bs * heads * dim

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(serve_one(p, d, f"r{i}", x, PARAMS) for i, x in enumerate(ps))))

    assert asyncio.run(main()) == expected(model_dir, ps, PARAMS, kv_cache_dtype="fp8")
    assert_no_blocks(p, d)


def test_seeded_sampling_across_workers_equals_offline(model_dir: Path) -> None:
    ps = prompts(1, 40, seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    p, d = make_pair(model_dir)
    assert asyncio.run(serve_one(p, d, "s", ps[0], params)) == expected(model_dir, ps, params)[0]


@pytest.mark.parametrize("fault", [None, "drop"])
def test_prompt_logprobs_cross_from_prefill_to_decode(model_dir: Path, fault: str | None) -> None:
    """The prefill worker scores the prompt; the decode worker's stream carries
    those entries once, in its first output (also when the KV is lost and the
    decode worker recomputes the prompt itself)."""
    ps = prompts(1, 50, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    want = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).generate(ps, params)[0]
    faults = Faults()
    if fault == "drop":
        faults.drop(layer=1)
    p, d = make_pair(model_dir, faults=faults)
    outs = asyncio.run(handoff_deltas(p, d, "pl", ps[0], params))
    assert [t for o in outs for t in o.outputs[0].token_ids] == want.outputs[0].token_ids
    got = outs[0].prompt_logprobs
    assert got is not None and len(got) == 50 and got[0] is None
    for g_entry, w_entry in zip(got[1:], want.prompt_logprobs[1:]):
        assert g_entry.keys() == w_entry.keys()
        assert all(abs(g_entry[t] - w_entry[t]) < 1e-4 for t in g_entry)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert d.num_transfer_failures == (1 if fault else 0)
    assert_no_blocks(p, d)


# A grammar across a recompute: the request's first token, sampled under it on the prefill
# worker, is replayed into the decode worker's matcher, which goes on from there.
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=60,
                             structured_outputs={"regex": r"[a-z]{3,8}( [a-z]{2,6}){2,5}"})


@pytest.mark.parametrize("params", [PARAMS, CONSTRAINED], ids=["plain", "regex"])
@pytest.mark.parametrize("fault", ["drop", "corrupt"])
def test_bad_kv_message_is_detected_and_recomputed(model_dir: Path, fault: str, params: SamplingParams) -> None:
    ps = prompts(1, 50, seed=5)
    faults = Faults()
    getattr(faults, fault)(layer=1)
    p, d = make_pair(model_dir, faults=faults)

    tokens = asyncio.run(serve_one(p, d, "f", ps[0], params))
    assert d.num_transfer_failures == 1
    assert tokens == expected(model_dir, ps, params)[0]  # re-prefilled on the decode worker: still right
    assert_no_blocks(p, d)


def test_fail_policy_raises_and_frees_both_sides(model_dir: Path) -> None:
    """The error says why the KV did not land (it said "timeout" whatever the cause)."""
    ps = prompts(1, 50, seed=6)
    faults = Faults()
    faults.corrupt(layer=0)
    p, d = make_pair(model_dir, policy=KVFailurePolicy.FAIL, faults=faults)
    with pytest.raises(TransferError) as err:
        asyncio.run(serve_one(p, d, "x", ps[0], PARAMS))
    assert err.value.reason is FailReason.CHECKSUM, err.value
    assert_no_blocks(p, d)


def test_fail_policy_names_a_prefill_worker_that_failed(model_dir: Path) -> None:
    class Broken(LocalPrefillPeer):
        async def prefill(self, order):  # type: ignore[no-untyped-def]
            raise RuntimeError("its engine died")

    ps = prompts(1, 50, seed=6)
    p, d = make_pair(model_dir, policy=KVFailurePolicy.FAIL)

    async def run() -> None:
        collector = TokenStreamCollector()
        try:
            collector.open("b", ps[0], 10.0)
            req = ServeRequest("b", tuple(ps[0]), PARAMS, 10.0, collector.address)
            async for _ in collector.consume("b", collector.watch("b", d.handoff(req, Broken(p)))):
                pass
        finally:
            await collector.close()

    with pytest.raises(TransferError) as err:
        asyncio.run(run())
    assert err.value.reason is FailReason.PEER_LOST and "RuntimeError" in str(err.value), err.value
    assert_no_blocks(p, d)


def test_reserved_blocks_are_released_when_their_kv_never_comes(model_dir: Path) -> None:
    """The prefill worker takes the order and is never heard of again (hung, or its
    answer lost): the reservation's lease (the remote prefill's budget) expires, the
    blocks go back, and the prompt is computed here instead."""
    class Silent(LocalPrefillPeer):
        async def prefill(self, order):  # type: ignore[no-untyped-def]
            await asyncio.sleep(3600)

    ps = prompts(1, 50, seed=7)
    p, d = make_pair(model_dir)
    d.prefill_timeout_s = 0.5

    async def run() -> list[int]:
        collector = TokenStreamCollector()
        try:
            collector.open("l", ps[0], 10.0)
            req = ServeRequest("l", tuple(ps[0]), PARAMS, 10.0, collector.address)
            outs = [o async for o in collector.consume("l", collector.watch("l", d.handoff(req, Silent(p))))]
            return [t for o in outs for t in o.outputs[0].token_ids]
        finally:
            await collector.close()

    assert asyncio.run(run()) == expected(model_dir, ps, PARAMS)[0]
    assert d.num_leases_expired == 1
    assert_no_blocks(p, d)
    assert d.receiver.num_registered == 0


def test_a_decode_engine_that_dies_during_a_handoff_fails_its_request_as_dead(model_dir: Path) -> None:
    """The decode worker's engine dies while the prefill worker works; the prefill's first
    token comes back after the death freed the request's KV registration. The client hears
    the dead engine (EngineDeadError, which the gateway moves elsewhere), not the missing
    registration (a KeyError: an internal error that ended a served stream under a killed
    tensor-parallel rank)."""
    ps = prompts(1, 50, seed=9)
    p, d = make_pair(model_dir)

    def crash() -> None:
        raise RuntimeError("the engine thread died (test)")

    class KillsTheDecodeEngine(LocalPrefillPeer):
        async def prefill(self, order):  # type: ignore[no-untyped-def]
            first = await super().prefill(order)
            d.async_engine.post(crash)
            deadline = time.monotonic() + 10
            while d.async_engine.healthy:
                assert time.monotonic() < deadline, "the decode engine never died"
                await asyncio.sleep(0.005)
            return first

    async def run() -> BaseException | None:
        collector = TokenStreamCollector()
        try:
            collector.open("k", ps[0], 10.0)
            req = ServeRequest("k", tuple(ps[0]), PARAMS, 10.0, collector.address)
            call = collector.watch("k", d.handoff(req, KillsTheDecodeEngine(p)))
            try:
                [o async for o in collector.consume("k", call)]
            except Exception as e:  # noqa: BLE001 - the error under test
                return e
            return None
        finally:
            await collector.close()

    error = asyncio.run(run())
    assert isinstance(error, EngineDeadError), repr(error)
    assert d.receiver.num_registered == 0
    assert d.engine.kv.pool.num_used == 0 and p.engine.kv.pool.num_used == 0


def test_blocks_queued_to_send_survive_a_preemption_of_their_request(model_dir: Path) -> None:
    """A prefill worker's link sends a request's finished blocks after the step that wrote them,
    on its own thread. If the request is preempted before the send reads them (KV pressure), its
    blocks must not go to another request meanwhile: the send would carry that request's KV,
    under a checksum of what it read, and the decode worker would decode from it (silently
    wrong tokens). Here the link is held inside the request's first send, the request is
    preempted, and every free block is taken and filled with garbage by "another request"
    until the send has read: the answer is still the offline one."""
    ps = prompts(1, 96, seed=10)  # three chunks of 32: the first chunk's blocks go while the rest computes
    p, d = make_pair(model_dir)
    sender = p._sender_for(d.receiver.address)  # the pair's one sender (make_pair's)
    reached, go, read = threading.Event(), threading.Event(), threading.Event()
    original = sender.send

    def held_send(request_id: str, *args: Any) -> None:
        if not reached.is_set():
            reached.set()
            assert go.wait(20), "the test never let the send go"
            original(request_id, *args)
            read.set()
            return
        original(request_id, *args)

    sender.send = held_send
    taken: list[int] = []

    def preempt_and_take(e: Any) -> None:
        req = e.scheduler.requests["a"]
        e.scheduler.running.remove(req)
        e.scheduler._preempt(req)  # what the scheduler does to its last running request under pressure
        taken.extend(e.kv.pool.allocate(e.kv.pool.num_free))
        index = torch.tensor(taken)
        for k, v in e.kv_caches:
            k[index] = 1000.0
            v[index] = -1000.0

    def give_back(e: Any) -> None:
        e.kv.pool.free(reversed(taken))

    # The preemption happens on the engine thread before the step after the held send began: the
    # request is still computing its later chunks then, however late the link thread or this
    # test's loop get a core (in a loaded CI run the prefill had finished before the test's call).
    preempted = threading.Event()
    step = p.engine.step

    def gated_step() -> Any:
        req = p.engine.scheduler.requests.get("a")
        if not preempted.is_set() and req is not None and req.num_computed_tokens > 0:
            assert reached.wait(20), "the first send never came"
            preempt_and_take(p.engine)
            preempted.set()
        return step()

    p.engine.step = gated_step  # type: ignore[method-assign]

    async def run() -> list[int]:
        serving = asyncio.ensure_future(serve_one(p, d, "a", ps[0], PARAMS))
        deadline = time.monotonic() + 20
        while not preempted.is_set():
            assert time.monotonic() < deadline and not serving.done(), "the request was never preempted"
            await asyncio.sleep(0.002)
        go.set()
        while not read.is_set():
            assert time.monotonic() < deadline + 20, "the held send never read its blocks"
            await asyncio.sleep(0.002)
        await p.async_engine.call(give_back)
        return await asyncio.wait_for(serving, 30)

    assert asyncio.run(run()) == expected(model_dir, ps, PARAMS)[0]
    assert p.engine.stats.preemptions == 0  # the test preempted it, not the scheduler
    assert_no_blocks(p, d)


class _LateReader:
    """A KV sender as KVSender's contract allows: `send` only queues, the blocks are read at
    `finish` (NCCL's gathers run later on their stream; ZeroMQ's I/O thread reads zero-copy
    frames after the call)."""

    def __init__(self, inner: InProcessSender) -> None:
        self.inner, self.queued, self.lock = inner, {}, threading.Lock()

    def send(self, transfer: str, layer: int, src: Any, dst: Any, deadline: float) -> None:
        with self.lock:
            self.queued.setdefault(transfer, []).append((layer, list(src), list(dst)))

    def finish(self, transfer: str, deadline: float) -> Any:
        with self.lock:
            queued = self.queued.pop(transfer, [])
        for layer, src, dst in queued:
            self.inner.send(transfer, layer, src, dst, deadline)
        return self.inner.finish(transfer, deadline)

    def abort(self, transfer: str, reason: str) -> None:
        with self.lock:
            self.queued.pop(transfer, None)
        self.inner.abort(transfer, reason)

    def close(self) -> None:
        self.inner.close()


def test_a_preempted_requests_sent_blocks_stay_held_until_its_transfer_ends(model_dir: Path) -> None:
    """A send returned, but its backend reads the blocks later (until `finish`): if the request
    is preempted meanwhile (KV pressure), its blocks must not go to another request before the
    transfer ends, or the decode worker decodes from that request's KV. Here the request is
    preempted once its first send returned, and every block that comes free is taken and
    filled with garbage until its transfer ended: the answer is still the offline one."""
    ps = prompts(1, 96, seed=10)  # three chunks of 32: the first chunk's blocks go while the rest computes
    engines = [LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32,
                   progress=False).engine for _ in range(2)]
    receiver = InProcessReceiver(engines[1].kv_caches)
    sender = _LateReader(InProcessSender(engines[0].kv_caches, receiver))
    d = DecodeWorker(engines[1], receiver, prefill_timeout_s=10.0).start()
    p = PrefillWorker(engines[0], lambda addr: sender).start()  # type: ignore[arg-type,return-value]
    _live.extend([p, d])
    held: list[int] = []  # blocks "another request" holds (with garbage) until the end
    preempted = threading.Event()
    step = p.engine.step

    seen = [0]  # steps begun since the first send returned

    def gated_step() -> Any:
        time.sleep(0.05)  # the link thread's send returns meanwhile
        e = p.engine
        req = e.scheduler.requests.get("a")
        queued = next(iter(sender.queued.values()), [])
        seen[0] += bool(queued)
        # A step after the one that saw it: what the send's return posted to the engine thread has run.
        if not preempted.is_set() and req is not None and req in e.scheduler.running and seen[0] >= 2:
            first = set(queued[0][1])  # the blocks of the first send, not read yet
            e.scheduler.running.remove(req)
            e.scheduler._preempt(req)  # what the scheduler does to its last running request under pressure
            taken = e.kv.pool.allocate(e.kv.pool.num_free)  # another request takes what came free
            index = torch.tensor(taken)
            for k, v in e.kv_caches:
                k[index] = 1000.0
                v[index] = -1000.0
            held.extend(b for b in taken if b in first)
            e.kv.pool.free(reversed([b for b in taken if b not in first]))
            preempted.set()
        return step()

    p.engine.step = gated_step  # type: ignore[method-assign]
    got = asyncio.run(asyncio.wait_for(serve_one(p, d, "a", ps[0], PARAMS), 60))
    p.async_engine.post(lambda: p.engine.kv.pool.free(reversed(held)))
    assert preempted.is_set()
    assert got == expected(model_dir, ps, PARAMS)[0]
    assert_no_blocks(p, d)


def test_a_request_that_ends_as_its_blocks_are_reserved_sends_no_prefill_order(model_dir: Path) -> None:
    """The gateway's abort lands just after the decode worker reserved the blocks: the prefill
    worker is not asked to compute the prompt for no one (the abort meant for it may have come
    before the order, where it found nothing to stop), and every block is free."""
    p, d = make_pair(model_dir)
    reserve = d._reserve

    def reserve_then_aborted(e: Any, job: Any, req: ServeRequest, peer: Any) -> Any:
        got = reserve(e, job, req, peer)
        d.async_engine.abort(req.request_id)
        return got

    d._reserve = reserve_then_aborted  # type: ignore[method-assign]
    orders: list[str] = []

    class Peer(LocalPrefillPeer):
        async def prefill(self, order: Any) -> Any:
            orders.append(order.request.request_id)
            return await super().prefill(order)

    prompt = prompts(1, 70)[0]

    async def run() -> BaseException | None:
        collector = TokenStreamCollector()
        try:
            collector.open("x", prompt, 10.0)
            try:
                await d.handoff(ServeRequest("x", tuple(prompt), PARAMS, 10.0, collector.address), Peer(p))
            except Exception as e:  # noqa: BLE001 - what the handoff ended with
                return e
            return None
        finally:
            await collector.close()

    before = p.engine.stats.prompt_tokens_computed
    error = asyncio.run(run())
    assert error is not None and "abort" in type(error).__name__.lower(), repr(error)
    assert orders == [] and p.engine.stats.prompt_tokens_computed == before
    assert d.receiver.num_registered == 0
    assert_no_blocks(p, d)


def test_the_first_token_reaches_the_client_before_the_kv_verdict(model_dir: Path) -> None:
    """The prefill worker publishes the first token when the prompt is done, not once the
    decode worker has verified the KV: with the end marker held back 3 s, the client has
    token 0 well within those 3 s (before, it came after them), and the answer is the
    offline one with no token twice."""
    ps = prompts(2, 50, seed=8)
    faults = Faults()
    p, d = make_pair(model_dir, faults=faults)
    d.prefill_timeout_s = 20.0  # the held end marker is no lease running out
    asyncio.run(serve_one(p, d, "warm", ps[1], PARAMS))  # compiled and warm: the prefill takes milliseconds
    faults.delay(3.0, end_marker=True)

    async def run() -> tuple[list[int], float, float]:
        collector = TokenStreamCollector()
        try:
            collector.open("e", ps[0], 20.0)
            req = ServeRequest("e", tuple(ps[0]), PARAMS, 20.0, collector.address)
            tokens: list[int] = []
            start, first = time.monotonic(), 0.0
            async for o in collector.consume("e", collector.watch("e", d.handoff(req, LocalPrefillPeer(p)))):
                first = first or time.monotonic() - start
                tokens += o.outputs[0].token_ids
            return tokens, first, time.monotonic() - start
        finally:
            await collector.close()

    tokens, ttft, total = asyncio.run(run())
    assert total >= 3.0 and ttft < 2.0
    assert tokens == expected(model_dir, ps[:1], PARAMS)[0]
    assert d.num_transfer_failures == 0
    assert_no_blocks(p, d)


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_request_whose_row_breaks_fails_alone_on_either_worker(model_dir: Path, where: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """One request's row raises in every step that samples it (what a top_k past int64 did):
    the others keep their tokens. On the decode worker it fails alone (RequestFaultError,
    which the gateway never migrates); on the prefill worker its handoff is abandoned and
    the decode worker computes it itself (the KV failure policy), so it is served whole."""
    ps = prompts(3, 40, seed=7)
    p, d = make_pair(model_dir)
    runner = (p if where == "prefill" else d).engine.runner
    real = runner._sampling_batch

    def sampling_batch(reqs: list[Any], *rest: Any) -> Any:
        if any(r.request_id == "bad" for r in reqs):
            raise OverflowError("Overflow when unpacking long long")
        return real(reqs, *rest)

    monkeypatch.setattr(runner, "_sampling_batch", sampling_batch)

    async def main() -> list[Any]:
        jobs = [serve_one(p, d, f"r{i}", x, PARAMS) for i, x in enumerate(ps)] + [serve_one(p, d, "bad", ps[0], PARAMS)]
        return list(await asyncio.gather(*jobs, return_exceptions=True))

    results = asyncio.run(main())
    want = expected(model_dir, ps, PARAMS)
    assert results[:3] == want
    if where == "decode":
        assert isinstance(results[3], RequestFaultError), results[3]
    else:
        assert results[3] == want[0]
    assert (p if where == "prefill" else d).engine.stats.request_faults == 1
    assert p.async_engine.healthy and d.async_engine.healthy
    assert_no_blocks(p, d)


def test_a_jobs_role_hears_of_steps_only_once_its_request_started(model_dir: Path) -> None:
    """A later try of a request is opened (on the event loop) while the engine may still
    hold the earlier try's request under the same id; its start is queued behind. Until
    that start runs, the engine's state under the id is not this try's: a prefill role
    acting on it would queue the earlier try's blocks as its own sends, or fail on an
    output that is not its own."""
    p, _ = make_pair(model_dir)
    ae = p.async_engine

    class Counting:
        steps = 0

        def take_output(self, out: Any) -> None:
            pass

        def after_step(self, engine: Any) -> None:
            self.steps += 1

    async def run() -> int:
        job = ae.open("k", 10.0)
        role = Counting()
        job.role = role
        for _ in range(3):  # each call wakes the engine thread for a round: a step, then its roles
            await ae.call(lambda e: None, timeout_s=5.0)
        ae.end(job, Exit.ABORTED)
        await ae.call(lambda e: None, timeout_s=5.0)
        return role.steps

    assert asyncio.run(run()) == 0


def test_a_prefill_that_cannot_open_its_link_ends_its_request_there(model_dir: Path) -> None:
    """The prefill worker cannot make the link to the decode worker (no thread or socket
    left): its request ends there, as any failed prefill does, and the decode worker
    computes the prompt itself (the `recompute` policy). Left open, the job would stay
    in the prefill worker's engine with nothing to end it."""
    ps = prompts(1, 40, seed=5)
    p, d = make_pair(model_dir)

    def no_link(address: str) -> Any:
        raise OSError("can't start new thread")

    p.link_to = no_link  # type: ignore[method-assign]

    async def run() -> list[int]:
        got = await serve_one(p, d, "k", ps[0], PARAMS)
        await p.async_engine.call(lambda e: None, timeout_s=5.0)  # its end has run on the engine thread
        return got

    assert asyncio.run(run()) == expected(model_dir, ps, PARAMS)[0]
    assert p.async_engine.num_in_flight == 0 and d.num_transfer_failures == 1
    assert_no_blocks(p, d)
