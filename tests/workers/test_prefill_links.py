"""A hung decode worker costs a prefill worker only its own transfers: the KV
leaves from a thread per link, so the prefill engine thread keeps serving every
other decode worker, and the hung link's transfers fail after
`transfer_timeout_s` (the decode worker then recomputes, by its policy)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import handoff_deltas, tiny_spec
from faults import Faults

from pdserve import LLM, SamplingParams
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def _engine(model_dir: Path):  # noqa: ANN202
    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32, progress=False).engine


def test_a_hung_decode_worker_does_not_hold_the_prefill_engine_thread(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 4000, (70,), generator=g).tolist()
    want = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).generate(
        [prompt], PARAMS)[0].outputs[0].token_ids

    p_engine = _engine(model_dir)
    hung_faults = Faults()
    hung_faults.stall_receiver()  # reads data but neither writes nor acks it: no credit, no verdict
    receivers: dict[str, ZmqKVReceiver] = {}
    decode: dict[str, DecodeWorker] = {}
    for name in ("hung", "ok"):
        engine = _engine(model_dir)
        receivers[name] = ZmqKVReceiver(engine.kv_caches, faults=hung_faults if name == "hung" else None)
        decode[name] = DecodeWorker(engine, receivers[name], prefill_timeout_s=20.0).start()
    senders: dict[str, ZmqKVSender] = {}

    def sender_for(address: str) -> ZmqKVSender:
        return senders.setdefault(address, ZmqKVSender(p_engine.kv_caches, address))

    prefill = PrefillWorker(p_engine, sender_for, transfer_timeout_s=1.5).start()
    done_at: dict[str, float] = {}

    async def one(name: str) -> list[int]:
        outs = await handoff_deltas(prefill, decode[name], f"r-{name}", prompt, PARAMS, timeout_s=30.0)
        done_at[name] = time.monotonic()
        return [t for o in outs for t in o.outputs[0].token_ids]

    async def main() -> tuple[list[int], list[int]]:
        hung = asyncio.create_task(one("hung"))
        await asyncio.sleep(0.3)  # the hung link's transfer is under way
        ok = await one("ok")
        return await hung, ok

    try:
        start = time.monotonic()
        hung_tokens, ok_tokens = asyncio.run(main())
        # The healthy link was served while the hung one waited for credit or verdict...
        assert done_at["ok"] < done_at["hung"]
        assert done_at["ok"] - start < 1.5
        # ...and the hung one's transfer gave up after its timeout, not the request's
        # deadline or the decode worker's 20 s budget: the prompt was recomputed there.
        assert done_at["hung"] - start < 8.0
        assert hung_tokens == want and ok_tokens == want
        assert decode["hung"].num_transfer_failures == 1 and decode["ok"].num_transfer_failures == 0
        for d in decode.values():
            assert d.engine.kv.pool.num_used == 0
        assert p_engine.kv.pool.num_used == 0
    finally:
        hung_faults.resume_receiver()
        prefill.close()
        for d in decode.values():
            d.close()
        for r in receivers.values():
            r.close()
        for s in senders.values():
            s.close()


def test_a_link_to_a_decode_worker_that_is_gone_is_retired(model_dir: Path) -> None:
    """A decode worker restarts at a new address: the prefill worker's link to the old
    one (its thread, its socket) goes once it has been unreachable for
    `link_retire_s`; what it counted still counts; the new worker is served."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(5, 4000, (40,), generator=g).tolist()
    want = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).generate(
        [prompt], PARAMS)[0].outputs[0].token_ids
    p_engine = _engine(model_dir)
    prefill = PrefillWorker(p_engine, lambda address: ZmqKVSender(p_engine.kv_caches, address),
                            transfer_timeout_s=5.0, link_retire_s=1.0).start()

    def link_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("kv-send")]

    def serve_once(name: str) -> tuple[list[int], ZmqKVReceiver, DecodeWorker]:
        engine = _engine(model_dir)
        receiver = ZmqKVReceiver(engine.kv_caches)
        decode = DecodeWorker(engine, receiver, prefill_timeout_s=20.0).start()
        outs = asyncio.run(handoff_deltas(prefill, decode, f"r-{name}", prompt, PARAMS, timeout_s=30.0))
        return [t for o in outs for t in o.outputs[0].token_ids], receiver, decode

    try:
        tokens, receiver, decode = serve_once("old")
        assert tokens == want and link_threads() == [f"kv-send {receiver.address}"]
        decode.close()
        receiver.close()  # the worker is gone; the next one listens elsewhere
        deadline = time.monotonic() + 8.0
        while prefill.num_links and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prefill.num_links == 0 and link_threads() == []
        assert prefill.link_counts().links_lost == 1  # the retired link's counter is kept

        tokens, receiver, decode = serve_once("new")
        assert tokens == want and link_threads() == [f"kv-send {receiver.address}"]
        assert p_engine.kv.pool.num_used == 0 and decode.engine.kv.pool.num_used == 0
        decode.close()
        receiver.close()
    finally:
        prefill.close()
    assert _wait_no_link_threads(link_threads)


def _wait_no_link_threads(link_threads: Callable[[], list[str]]) -> bool:
    deadline = time.monotonic() + 3.0
    while link_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not link_threads()
