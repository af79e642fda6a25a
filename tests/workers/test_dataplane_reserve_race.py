"""The reserve/abort race (issue 16, item 6), driven step by step with events, no sleeps.

A decode worker reserves a request's blocks and registers them with its KV receiver on its engine
thread. A client that leaves in the middle of that, or a later try of the same request that takes
over, must never leave a ledger registration pointing at blocks that were freed (and may already be
someone else's): KV that arrives late for it would be written into them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import FirstToken, PrefillOrder, ServeRequest, transfer_key
from pdserve.workers.messages import TransferState
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer import TransferError
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

WAIT_S = 10.0  # every wait below has this deadline; none is expected to come near it
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2))


class GatedReceiver(InProcessReceiver):
    """Holds the engine thread inside `register` (blocks reserved, not yet registered) until `go`."""

    def __init__(self, kv_caches: Any) -> None:
        super().__init__(kv_caches)
        self.entered, self.go = threading.Event(), threading.Event()
        self.go.set()

    def register(self, request_id: str, dst_block_ids: Sequence[int], expected_layers: int) -> None:
        self.entered.set()
        assert self.go.wait(WAIT_S), "the test never let the reservation go on"
        super().register(request_id, dst_block_ids, expected_layers)


class HeldPeer:
    """A prefill worker that answers each try when the test says: with an error, or never."""

    def __init__(self) -> None:
        self.orders: list[PrefillOrder] = []
        self.answers: dict[int, asyncio.Future[FirstToken]] = {}
        self.called = asyncio.Event()

    async def prefill(self, order: PrefillOrder) -> FirstToken:
        self.orders.append(order)
        answer = self.answers.setdefault(order.request.attempt, asyncio.get_running_loop().create_future())
        self.called.set()
        return await asyncio.wait_for(answer, WAIT_S)

    def abort(self, request_id: str, attempt: int) -> None:
        pass


@pytest.fixture
def worker(model_dir: Path) -> Iterator[DecodeWorker]:
    engine = LLM(str(model_dir), max_model_len=128, num_kv_blocks=32, progress=False).engine
    d = DecodeWorker(engine, GatedReceiver(engine.kv_caches)).start()
    yield d
    d.close()


async def _settled(d: DecodeWorker) -> None:
    await d.async_engine.call(lambda e: None, timeout_s=WAIT_S)  # every command queued before has run


def _late_kv(d: DecodeWorker, key: str, blocks: list[int], abort: bool = False) -> None:
    """KV of the transfer `key` (a try's `transfer_key`) that arrives after the try ended here (the
    prefill worker had not heard yet); with `abort`, then that transfer's abort."""
    sender = InProcessSender(d.engine.kv_caches, d.receiver)  # type: ignore[arg-type]
    try:
        sender.send(key, 0, blocks, blocks, deadline=time.monotonic() + WAIT_S)
    except TransferError:
        pass  # refused: what must happen
    if abort:
        sender.abort(key, "the earlier try's prefill ended")


def test_a_client_leaving_while_its_blocks_are_reserved_leaves_no_registration(worker: DecodeWorker) -> None:
    d, receiver = worker, worker.receiver
    assert isinstance(receiver, GatedReceiver)

    async def main() -> None:
        collector = TokenStreamCollector()
        receiver.go.clear()
        req = ServeRequest("gone", tuple(range(5, 45)), PARAMS, WAIT_S, collector.address)
        handoff = asyncio.ensure_future(d.handoff(req, HeldPeer()))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, receiver.entered.wait, WAIT_S)  # blocks reserved, mid-register
        assert d.engine.kv.pool.num_used > 0
        handoff.cancel()  # the client leaves (the gateway's call is cancelled) ...
        d.abort("gone")  # ... and the gateway aborts the request here: its exit is queued now
        receiver.go.set()  # the engine thread finishes the reservation it was in
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(handoff, WAIT_S)
        await _settled(d)
        assert receiver.num_registered == 0  # nothing points at the freed blocks
        assert d.engine.kv.pool.num_used == 0 and not d.engine.has_unfinished_requests()

        # Those blocks go to the next request; KV that comes late for the one that left is refused.
        before = [(k.clone(), v.clone()) for k, v in d.engine.kv_caches]
        _late_kv(d, transfer_key("gone", 0), [0, 1])
        assert all(k.equal(k0) and v.equal(v0) for (k, v), (k0, v0) in zip(d.engine.kv_caches, before))
        await collector.close()

    asyncio.run(main())


def test_a_later_try_keeps_its_registration_when_the_earlier_try_gives_up(worker: DecodeWorker) -> None:
    """Try 0's prefill fails after try 1 of the same request took over (same id, its own blocks): try 0
    must not release try 1's live registration, and its transfer's late KV and abort (the prefill
    worker had not heard yet) must not touch it: each try registers under its own key."""
    d, receiver = worker, worker.receiver

    async def main() -> None:
        collector = TokenStreamCollector()
        peer = HeldPeer()
        prompt = tuple(range(5, 45))
        try0 = asyncio.ensure_future(d.handoff(ServeRequest("r", prompt, PARAMS, WAIT_S, collector.address), peer))
        await asyncio.wait_for(peer.called.wait(), WAIT_S)  # try 0 reserved and registered; its prefill runs
        peer.called.clear()
        try1 = asyncio.ensure_future(d.handoff(ServeRequest("r", prompt, PARAMS, WAIT_S, collector.address,
                                                            attempt=1), peer))
        await asyncio.wait_for(peer.called.wait(), WAIT_S)  # try 1 superseded it, reserved and registered
        key = transfer_key("r", 1)
        assert receiver.poll(key).state is TransferState.PENDING
        peer.answers[0].set_exception(RuntimeError("try 0's prefill worker failed"))
        await asyncio.wait_for(asyncio.gather(try0, return_exceptions=True), WAIT_S)
        await _settled(d)
        _late_kv(d, transfer_key("r", 0), list(peer.orders[0].reservation.block_ids[:1]), abort=True)
        # Try 1's registration is still there, for its blocks, which are still reserved.
        assert receiver.poll(key).state is TransferState.PENDING
        assert receiver.num_registered == 1 and d.engine.kv.pool.num_used > 0
        try1.cancel()
        await asyncio.gather(try1, return_exceptions=True)
        await _settled(d)
        assert receiver.num_registered == 0 and d.engine.kv.pool.num_used == 0
        await collector.close()

    asyncio.run(main())
