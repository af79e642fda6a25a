"""A prefill worker over the NCCL transport (its gloo path on the CPU): the engine thread only records
what to send; the sends and `finish`, which waits for the decode worker's verdict, run on the link's
thread. So a decode worker slow to say DONE holds neither the engine thread nor the other requests, and
blocks held for a transfer go back on every exit. Every wait here has a deadline."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from factories import handoff_deltas, tiny_spec
from faults import Faults

from pdserve import LLM, SamplingParams
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import transfer_key
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def _engine(model_dir: Path) -> Any:
    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, progress=False).engine


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tokens(outs: list[Any]) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


class _Cluster:
    """One prefill worker (NCCL senders) and decode workers (NCCL receivers), all in this process."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.p_engine = _engine(model_dir)
        self.senders: list[NcclKVSender] = []
        self.finishes: list[tuple[str, str]] = []  # (request id, thread) of each finish, as it starts
        self.finishing = threading.Event()
        self.receivers: list[NcclKVReceiver] = []
        self.decoders: list[DecodeWorker] = []
        self.prefill = PrefillWorker(self.p_engine, self._sender_for, transfer_timeout_s=10.0).start()

    def _sender_for(self, address: str) -> NcclKVSender:
        sender = NcclKVSender(self.p_engine.kv_caches, address, group_timeout_s=5.0)
        finish = sender.finish

        def watched(request_id: str, deadline: float) -> None:
            self.finishes.append((request_id, threading.current_thread().name))
            self.finishing.set()
            finish(request_id, deadline)

        sender.finish = watched  # type: ignore[method-assign]
        self.senders.append(sender)
        return sender

    def decode_worker(self, **receiver_kw: Any) -> DecodeWorker:
        engine = _engine(self.model_dir)
        receiver = NcclKVReceiver(engine.kv_caches, group_timeout_s=5.0, **receiver_kw)
        self.receivers.append(receiver)
        self.decoders.append(DecodeWorker(engine, receiver, prefill_timeout_s=20.0).start())
        return self.decoders[-1]

    def want(self, prompt: list[int]) -> list[int]:
        return list(LLM(str(self.model_dir), max_model_len=256, num_kv_blocks=64, progress=False).generate(
            [prompt], PARAMS)[0].outputs[0].token_ids)

    def blocks_in_use(self) -> list[int]:
        return [self.p_engine.kv.pool.num_used] + [d.engine.kv.pool.num_used for d in self.decoders]

    def close(self) -> None:
        self.prefill.close()
        for d in self.decoders:
            d.close()
        for r in self.receivers:
            r.close()
        for s in self.senders:
            s.close()


@pytest.fixture
def cluster(model_dir: Path) -> Iterator[_Cluster]:
    made = _Cluster(model_dir)
    yield made
    made.close()


def test_a_decode_worker_slow_to_say_done_holds_neither_the_engine_thread_nor_other_requests(
        cluster: _Cluster) -> None:
    slow_faults = Faults()
    slow, fast = cluster.decode_worker(faults=slow_faults), cluster.decode_worker()
    slow_prompt, fast_prompt = _prompt(1, 70), _prompt(2, 45)  # 70 tokens: three chunks, KV sent after each
    want_slow, want_fast = cluster.want(slow_prompt), cluster.want(fast_prompt)

    async def main() -> tuple[list[int], list[int]]:
        slow_faults.stall_receiver()  # takes the bytes, then neither acks nor says DONE until resumed
        slow_job = asyncio.create_task(handoff_deltas(cluster.prefill, slow, "r-slow", slow_prompt, PARAMS, 30.0))
        assert await asyncio.to_thread(cluster.finishing.wait, 10.0), "the slow request never reached finish"
        # Its finish now waits for a verdict that does not come. The prefill engine goes on stepping:
        fast_outs = await asyncio.wait_for(
            handoff_deltas(cluster.prefill, fast, "r-fast", fast_prompt, PARAMS, 30.0), timeout=20.0)
        assert not slow_job.done()  # still waiting for its DONE: the fast one did not wait behind it
        slow_faults.resume_receiver()
        slow_outs = await asyncio.wait_for(slow_job, timeout=20.0)
        return _tokens(slow_outs), _tokens(fast_outs)

    try:
        slow_tokens, fast_tokens = asyncio.run(main())
    finally:
        slow_faults.resume_receiver()
    assert slow_tokens == want_slow and fast_tokens == want_fast  # exact KV: greedy output as colocated
    assert [d.num_transfer_failures for d in cluster.decoders] == [0, 0]
    assert {rid for rid, _ in cluster.finishes} == {transfer_key("r-slow", 0), transfer_key("r-fast", 0)}
    assert all(thread.startswith("kv-send ") for _, thread in cluster.finishes)  # the links' threads
    assert cluster.blocks_in_use() == [0, 0, 0]
    assert sum(s.num_checksummed for s in cluster.senders) == 0  # the default: no host checksum
    assert sum(r.num_checksummed for r in cluster.receivers) == 0


def test_a_transfer_whose_data_channel_breaks_frees_its_blocks_on_both_sides(cluster: _Cluster) -> None:
    # The receiver takes no message over 64 bytes: the first one breaks the pair, the transfer fails with
    # CLOSED, and the decode worker recomputes the prompt (its default policy).
    broken = cluster.decode_worker(max_message_bytes=64)
    prompt = _prompt(3, 40)
    outs = asyncio.run(asyncio.wait_for(handoff_deltas(cluster.prefill, broken, "r-broken", prompt, PARAMS, 30.0),
                                        timeout=30.0))
    assert _tokens(outs) == cluster.want(prompt)
    assert broken.num_transfer_failures == 1
    assert cluster.blocks_in_use() == [0, 0]
