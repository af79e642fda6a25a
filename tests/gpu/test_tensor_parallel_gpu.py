"""Tensor parallelism on GPUs (docs/tensor-parallel.md, "GPUs"): the tests only a machine with two
GPUs or more can run (bench/gpu_check.sh runs tests/gpu on a lent one; everywhere else, and on
one card, they are skipped). NONE HAS RUN YET: every lent machine so far had one GPU. The oracle
is the same engine on one rank, as on CPU (tests/workers/test_tensor_parallel.py): NCCL's
all-reduces in float32 leave the tokens and, within 1e-4, the logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import handoff_deltas, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import KVFailurePolicy
from pdserve.workers.kv.shared_cache import ShardedKV
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import Arch, TinyModelSpec
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

GQA = tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2)
QWEN2_ONE_KV = tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=1, init_std=0.1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """What a test opens, closed after it, the last opened first (workers before their engines)."""
    with contextlib.ExitStack() as opened:
        yield opened


def _llm(stack: contextlib.ExitStack, model_dir: Path, tp: int, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(device="cuda", dtype="float32", max_model_len=512, num_kv_blocks=128,
                                progress=False, tensor_parallel_size=tp)
    llm = LLM(str(model_dir), **{**args, **kw})
    stack.callback(llm.close)
    return llm


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (5, 40, 130)] + [[11, 12, 13, 14] * 12]


def _same(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert max(abs(float(x[t]) - float(lp)) for t, lp in y.items()) < 1e-4


@pytest.mark.parametrize("spec", [GQA, QWEN2_ONE_KV], ids=["llama-gqa", "qwen2-one-kv-head"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_two_gpu_ranks_give_one_ranks_tokens(spec: TinyModelSpec, eager: bool, stack: contextlib.ExitStack,
                                             make_model: Callable[[TinyModelSpec], Path]) -> None:
    """NCCL between cuda:0 and cuda:1, eager and replayed from CUDA graphs with the all-reduce
    inside (every rank replays the bucket rank 0 names)."""
    model_dir = make_model(spec)
    ps = _prompts(1000)
    want = _llm(stack, model_dir, 1, enforce_eager=True).generate(ps, GREEDY)
    llm = _llm(stack, model_dir, 2, enforce_eager=eager)
    assert (llm.engine.runner.graphs is None) is eager
    _same(llm.generate(ps, GREEDY), want)
    if not eager:
        assert llm.engine.runner.graphs is not None
        assert any(b.replays for b in llm.engine.runner.graphs.decode)


def test_two_gpu_ranks_plan_their_pool_from_measured_memory(stack: contextlib.ExitStack,
                                                            make_model: Callable[[TinyModelSpec], Path]) -> None:
    """No pool size given: every rank runs the profile steps on its GPU, the tightest plans (each
    plan is logged); the pool holds half the heads a block, so at least as many
    blocks as one rank's plan, and serves one rank's tokens."""
    model_dir = make_model(GQA)
    with contextlib.ExitStack() as first:  # closed before the two ranks measure: its memory is back
        one = _llm(first, model_dir, 1, num_kv_blocks=None, gpu_memory_utilization=0.3, enforce_eager=True)
        blocks_one = one.engine.num_kv_blocks
        want = one.generate(_prompts(1000), GREEDY)
    del one
    gc.collect()
    torch.cuda.empty_cache()
    two = _llm(stack, model_dir, 2, num_kv_blocks=None, gpu_memory_utilization=0.3, enforce_eager=True)
    assert two.engine.num_kv_blocks >= blocks_one > 0
    _same(two.generate(_prompts(1000), GREEDY), want)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_kv_between_gpu_workers_of_different_sizes(p_tp: int, d_tp: int, stack: contextlib.ExitStack,
                                                   make_model: Callable[[TinyModelSpec], Path]) -> None:
    """P TP=p -> D TP=d in one process (the one-rank engine shares cuda:0 with the other's rank 0):
    the followers' caches opened over CUDA IPC, re-sharded by head; one rank's greedy tokens, and
    no block left on either side. Prompts of several chunks (steps that sample nothing, after
    which only stream order keeps a follower's KV writes ahead of the sender's reads), handed off
    at once (blocks that are not in a row)."""
    model_dir = make_model(QWEN2_ONE_KV)
    ps = _prompts(1000)
    want = _llm(stack, model_dir, 1, enforce_eager=True).generate(ps, GREEDY)
    p_engine = _llm(stack, model_dir, p_tp, max_num_batched_tokens=32).engine
    d_engine = _llm(stack, model_dir, d_tp, max_num_batched_tokens=32).engine
    sharded = p_engine if p_tp > 1 else d_engine
    assert isinstance(sharded.transfer_kv, ShardedKV)
    assert [c[0][0].device.index for c in sharded.transfer_kv.ranks] == [0, 1]
    receiver = InProcessReceiver(d_engine.transfer_kv)
    sender = InProcessSender(p_engine.transfer_kv, receiver)
    decode = DecodeWorker(d_engine, receiver, KVFailurePolicy.FAIL, prefill_timeout_s=60.0)
    prefill = PrefillWorker(p_engine, lambda addr: sender).start()
    stack.callback(prefill.close)
    stack.callback(decode.start().close)

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(handoff_deltas(prefill, decode, f"r{i}", x, GREEDY, timeout_s=120.0)
                                           for i, x in enumerate(ps))))

    for deltas, w in zip(asyncio.run(main()), want, strict=True):
        assert [t for out in deltas for t in out.outputs[0].token_ids] == w.outputs[0].token_ids
    deadline = time.monotonic() + 10.0  # a side that did not wait for the other frees a moment later
    while (p_engine.kv.pool.num_used or d_engine.kv.pool.num_used) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p_engine.kv.pool.num_used == d_engine.kv.pool.num_used == 0
