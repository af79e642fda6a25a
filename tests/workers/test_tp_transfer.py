"""KV between workers of different tensor-parallel sizes (workers/kv/shared_cache.py): a worker's
ranks keep their caches in one shared file, its transfers move the full model's heads, and a
prefill worker of p ranks hands a decode worker of d ranks the KV a single-rank worker would."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from factories import handoff_deltas, tiny_spec
from faults import Faults

from pdserve import LLM, SamplingParams
from pdserve.workers.decode_worker import DecodeWorker
from pdserve.workers.handoff import KVFailurePolicy
from pdserve.workers.kv import shared_cache
from pdserve.workers.kv.shared_cache import ShardedKV
from pdserve.workers.model.tensor_parallel import TensorParallel
from pdserve.workers.prefill_worker import PrefillWorker
from pdserve.workers.tiny.builder import Arch, TinyModelSpec
from pdserve.workers.transfer import frames
from pdserve.workers.transfer.frames import CacheGeometry
from pdserve.workers.transfer.inprocess import InProcessReceiver, InProcessSender
from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender
from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

CASES = {
    "llama-two-kv-heads": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05),
    # One KV head for two ranks: each holds a copy; a transfer reads one and writes both.
    "qwen2-one-kv-head": tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=1, init_std=0.1),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
# A request's deadline: ranks on gloo take seconds on two busy cores (10 s, the helper's default, ran
# out in a CI run that shared the machine with another job).
REQUEST_TIMEOUT_S = 60.0


def _split(full: list[tuple[torch.Tensor, torch.Tensor]], size: int, kv_heads: int) -> ShardedKV:
    """`full` (per layer K, V with every head) as `size` ranks would hold it."""
    cfg: Any = SimpleNamespace(num_kv_heads=kv_heads)  # all that kv_heads reads
    heads = [TensorParallel(size, r).kv_heads(cfg) for r in range(size)]
    # Each rank's own cache, as GPU ranks' are (ShardedKV.of_ranks; CPU engines map one shared file).
    return ShardedKV.of_ranks([[(k[:, :, f : f + n].clone(), v[:, :, f : f + n].clone()) for k, v in full]
                               for f, n in heads], cfg)


@pytest.mark.parametrize("size, kv_heads", [(2, 2), (2, 4), (2, 1), (4, 2)])
@pytest.mark.parametrize("ids", [[3, 4, 5], [6, 1, 9]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_the_ranks_caches_move_as_the_whole_models_blocks(size: int, kv_heads: int, ids: list[int],
                                                          dtype: torch.dtype) -> None:
    """gather over the ranks' caches gives the bytes gather over the whole cache gives; scatter of
    those bytes writes each rank its heads (every copy of a replicated head); an fp8 cache too."""
    g = torch.Generator().manual_seed(size * 10 + kv_heads)
    full = [tuple(torch.randn(12, 4, kv_heads, 8, generator=g).to(dtype) for _ in "kv") for _ in range(3)]
    sharded = _split(full, size, kv_heads)
    geometry = CacheGeometry.of(sharded)
    assert geometry == CacheGeometry.of(full)
    for layer in range(3):
        want_k, want_v = frames.gather(full, layer, ids)
        got_k, got_v = frames.gather(sharded, layer, ids)
        assert bytes(got_k) == bytes(want_k) and bytes(got_v) == bytes(want_v)
        assert frames.cache_frames(sharded, layer, ids) is None  # never views: the heads interleave

    empty = _split([(torch.zeros_like(k), torch.zeros_like(v)) for k, v in full], size, kv_heads)
    for layer in range(3):
        k_frame, v_frame = frames.gather(full, layer, ids)
        frames.scatter(empty, geometry, layer, ids, bytes(k_frame), bytes(v_frame))  # read-only, as received
    def raw(t: torch.Tensor) -> torch.Tensor:  # bytes compare (fp8 has no equal or any on CPU)
        return t.contiguous().view(torch.uint8)

    for r, (first, n) in enumerate(empty.heads):
        for layer, (k, v) in enumerate(empty.ranks[r]):
            assert torch.equal(raw(k[ids]), raw(full[layer][0][ids][:, :, first : first + n]))
            assert torch.equal(raw(v[ids]), raw(full[layer][1][ids][:, :, first : first + n]))
            others = [b for b in range(12) if b not in ids]
            assert not raw(k[others]).any() and not raw(v[others]).any()


@pytest.fixture(scope="module", params=list(CASES))
def model_dir(request: pytest.FixtureRequest, make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(CASES[request.param])


_live: list[Any] = []


@pytest.fixture(autouse=True)
def _close() -> Iterator[None]:
    yield
    while _live:
        _live.pop().close()


def _llm(model_dir: Path, tp: int, **kw: Any) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=32,
              progress=False, tensor_parallel_size=tp, **kw)
    _live.append(llm)
    return llm


_oracles: dict[tuple[str, str], Any] = {}


def _oracle(model_dir: Path, name: str, run: Callable[[], Any]) -> Any:
    """A single-rank engine's outputs, once per model and use: each test that compares with one
    ran the same engine on the same greedy requests (one engine start less per test)."""
    key = (str(model_dir), name)
    if key not in _oracles:
        _oracles[key] = run()
    return _oracles[key]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    # Repetition in the last prompt gives the n-gram proposer drafts to verify.
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (9, 70)] + [[11, 12, 13, 14] * 12]


def test_a_tensor_parallel_engines_ranks_share_their_caches(model_dir: Path) -> None:
    """The KV a TP=2 engine's transfers read (every rank's part, from rank 0's process) is the KV a
    TP=1 engine wrote for the same prompt, within float32's noise; the shared file is gone.
    Then the same two engines profiled (one engine pair less for the suite): see `_check_profile`."""
    before = {f for f in os.listdir("/dev/shm") if f.startswith("pdserve-tpkv-")}
    prompt = _prompts(1000)[1]
    kvs, llms = [], []
    for tp in (1, 2):
        llm = _llm(model_dir, tp)
        llms.append(llm)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        kv = llm.engine.transfer_kv
        assert isinstance(kv, ShardedKV) == (tp == 2)
        blocks = list(range(4))  # the prompt's first 64 tokens: blocks 0-3 of a fresh pool
        kvs.append([frames.gather(kv, layer, blocks) for layer in range(CacheGeometry.of(kv).num_layers)])
    for (k1, v1), (k2, v2) in zip(*kvs, strict=True):
        for a, b in ((k1, k2), (v1, v2)):
            assert torch.allclose(torch.from_numpy(a).view(torch.float32), torch.from_numpy(b).view(torch.float32),
                                  atol=1e-4, rtol=1e-4)
    assert {f for f in os.listdir("/dev/shm") if f.startswith("pdserve-tpkv-")} == before
    _check_profile(llms[0].engine, llms[1].engine)


def _no_blocks_left(*workers: PrefillWorker | DecodeWorker, timeout_s: float = 10.0) -> bool:
    """Whether every worker's blocks are back within `timeout_s`: a side that did not wait for the
    other (a prefill worker hears of a failed transfer after its decode worker has gone on) frees
    them on its engine thread a moment later, which a loaded machine stretches."""
    deadline = time.monotonic() + timeout_s
    while any(w.engine.kv.pool.num_used for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(w.engine.kv.pool.num_used for w in workers)


def _pair(model_dir: Path, p_tp: int, d_tp: int, transport: str, faults: Faults | None = None,
          policy: KVFailurePolicy = KVFailurePolicy.FAIL, **kw: Any) -> tuple[PrefillWorker, DecodeWorker]:
    p_engine, d_engine = _llm(model_dir, p_tp, **kw).engine, _llm(model_dir, d_tp, **kw).engine
    receiver: Any
    if transport == "inprocess":
        receiver = InProcessReceiver(d_engine.transfer_kv)
        sender: Any = InProcessSender(p_engine.transfer_kv, receiver, faults)
    else:  # a network transport: ZeroMQ, or the NCCL backend's pair groups (gloo on CPU caches)
        receiver_cls, sender_cls = ((ZmqKVReceiver, ZmqKVSender) if transport == "zmq"
                                    else (NcclKVReceiver, NcclKVSender))
        receiver = receiver_cls(d_engine.transfer_kv)
        sender = sender_cls(p_engine.transfer_kv, receiver.address)
        _live.extend([sender, receiver])
    # A lost message shows at the deadline: a few seconds leave time to recompute.
    decode = DecodeWorker(d_engine, receiver, policy, prefill_timeout_s=60.0 if faults is None else 3.0)
    pair = PrefillWorker(p_engine, lambda addr: sender).start(), decode.start()
    _live[:0] = pair  # closed before their engines
    return pair


# Each model both ways, ZeroMQ both ways and with each model, in-process 2 -> 1, gloo 1 -> 2 into
# the replicated KV head (4 cases, not 8: the suite's time; the transports move the same frames).
@pytest.mark.parametrize("model_dir, p_tp, d_tp, transport", [
    ("llama-two-kv-heads", 1, 2, "zmq"), ("llama-two-kv-heads", 2, 1, "inprocess"),
    ("qwen2-one-kv-head", 2, 1, "zmq"), ("qwen2-one-kv-head", 1, 2, "gloo")], indirect=["model_dir"])
def test_prefill_and_decode_of_different_tensor_parallel_sizes_decode_as_one_rank(
        model_dir: Path, p_tp: int, d_tp: int, transport: str) -> None:
    """P TP=p -> D TP=d over the transfer, n-gram speculation on the decode side: greedy tokens equal
    a single-rank offline engine's, logprobs within 1e-4; no block left on either side."""
    spec: dict[str, Any] = {"speculative": "ngram", "num_speculative_tokens": 3, "spec_max_batch_size": 8,
                            "spec_token_cost": 0.01}  # drafts at every batch, whatever the step costs
    ps = _prompts(1000)
    whole = _oracle(model_dir, "ngram", lambda: _llm(model_dir, 1, **spec).generate(ps, GREEDY, use_tqdm=False))
    p, d = _pair(model_dir, p_tp, d_tp, transport, **spec)

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(handoff_deltas(p, d, f"r{i}", x, GREEDY, timeout_s=REQUEST_TIMEOUT_S)
                                           for i, x in enumerate(ps))))

    got = asyncio.run(main())
    for deltas, want in zip(got, whole, strict=True):
        tokens = [t for out in deltas for t in out.outputs[0].token_ids]
        logprobs = [lp for out in deltas for lp in (out.outputs[0].logprobs or [])]
        assert tokens == want.outputs[0].token_ids
        for a, b in zip(logprobs, want.outputs[0].logprobs or [], strict=True):
            for t, lp in b.items():
                assert abs(float(a[t]) - float(lp)) < 1e-4
    assert d.engine.stats.spec_accepted_tokens > 0  # drafts were verified over the transferred KV
    assert _no_blocks_left(p, d)


# Every pair of model, direction and fault once (4 cases, not 8: the suite's time).
@pytest.mark.parametrize("model_dir, p_tp, d_tp, fault", [
    ("llama-two-kv-heads", 2, 1, "drop"), ("llama-two-kv-heads", 1, 2, "corrupt"),
    ("qwen2-one-kv-head", 2, 1, "corrupt"), ("qwen2-one-kv-head", 1, 2, "drop")], indirect=["model_dir"])
def test_a_bad_kv_message_between_sizes_is_recomputed_as_one_request(model_dir: Path, p_tp: int, d_tp: int,
                                                                      fault: str) -> None:
    """One worker pair, one link, whatever the ranks: a dropped or corrupted layer of the full-head
    frames fails the transfer as one, the decode worker (on all its ranks) prefills the prompt
    itself, and its tokens are still one rank's; no block is left on either side."""
    faults = Faults()
    getattr(faults, fault)(layer=1)
    prompt = _prompts(1000)[1]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _oracle(model_dir, "12 tokens",
                   lambda: _llm(model_dir, 1).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    p, d = _pair(model_dir, p_tp, d_tp, "inprocess", faults, KVFailurePolicy.RECOMPUTE)
    got = asyncio.run(handoff_deltas(p, d, "f", prompt, params, timeout_s=REQUEST_TIMEOUT_S))
    assert [t for out in got for t in out.outputs[0].token_ids] == want
    assert d.num_transfer_failures == 1
    assert _no_blocks_left(p, d)


def test_a_tensor_parallel_engine_without_shared_caches_refuses_to_transfer(
        monkeypatch: pytest.MonkeyPatch, make_model: Callable[[TinyModelSpec], Path]) -> None:
    """No room in /dev/shm for the shared file: the ranks keep private caches, the engine still
    generates, and asking it for its KV as a transfer sees it is a clear error, not rank 0's heads."""
    monkeypatch.setattr(shared_cache, "reserve", lambda *a, **k: False)
    llm = _llm(make_model(CASES["llama-two-kv-heads"]), 2)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="private KV caches"):
        _ = llm.engine.transfer_kv


def _check_profile(one: Any, two: Any) -> None:
    """`pdserve profile -tp 2`'s parts, on a one-rank engine and a two-rank one of the same model:
    the engine shape says 2 ranks, the model is the whole model (not rank 0's shard), and its KV
    handoffs move every head (bytes of a one-rank worker's)."""
    from pdserve.cluster.planner.profile_transfer import kv_bytes_per_token, measure_transfer
    from pdserve.cluster.planner.profiler import engine_shape, model_info
    from pdserve.workers.transfer.base import Transport

    assert engine_shape(two, 1).tensor_parallel_size == 2 and engine_shape(one, 1).tensor_parallel_size == 1
    assert model_info(two) == model_info(one) | {"parameters": model_info(two)["parameters"]}
    assert kv_bytes_per_token(two) == kv_bytes_per_token(one)
    points = measure_transfer(two, Transport.ZMQ, (16, 64), 1, lambda msg: None)
    assert [p.bytes for p in points] == [16 * kv_bytes_per_token(one), 64 * kv_bytes_per_token(one)]
