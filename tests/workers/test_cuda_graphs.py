"""Decode steps replayed from graphs (workers/cuda_graphs.py), on CPU.

There are no CUDA graphs on CPU, so a stand-in graph "captures" by keeping the callable and
"replays" by running it again over the same persistent buffers. That holds the runner to
what a real graph needs: a replay sees only the device buffers and the host plans fixed at
capture, batches are padded up to their bucket with rows that write no KV, and steps that fit
no bucket run eagerly. Replayed steps must give the eager engine's tokens and log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec
from spec_decode_helpers import prompts as repetitive_prompts

from pdserve import LLM, SamplingParams
from pdserve.kernels import cpu_decode
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers import cuda_graphs
from pdserve.workers.cuda_graphs import DecodeGraphs, decode_buckets
from pdserve.workers.model_runner import HostStep
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


class FakeGraph:
    """A CUDA graph stand-in: capture keeps the callable, replay runs it again."""

    captured: list[FakeGraph] = []

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None
        self._pool: object | None = None

    def capture(self, fn: Callable[[], None], pool: Any) -> None:
        self.fn, self._pool = fn, pool if pool is not None else object()
        FakeGraph.captured.append(self)

    def replay(self) -> None:
        assert self.fn is not None
        self.fn()

    def pool(self) -> Any:
        return self._pool


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


@pytest.fixture(params=["reference", "cpu_op"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both CPU attention paths: the PyTorch reference, and the C++ decode op."""
    if request.param == "reference":
        monkeypatch.setattr(cpu_decode, "usable", lambda *args: False)
    elif cpu_decode.load() is None:
        pytest.skip("the CPU decode op cannot be built here")
    yield request.param


def make_llm(model_dir: Path, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=8,
                                attention_backend="torch", progress=False)
    args.update(kw)
    return LLM(str(model_dir), **args)


def with_graphs(llm: LLM, buckets: list[int] | None = None) -> DecodeGraphs:
    """Capture stand-in graphs on `llm`'s runner, as the engine does on CUDA."""
    eng = llm.engine
    config = dataclasses.replace(eng.config, enforce_eager=False)
    if buckets is None:
        graphs = cuda_graphs.capture(config, eng.runner, AttentionBackend.TORCH, graph_factory=FakeGraph)
        assert graphs is not None
    else:
        graphs = DecodeGraphs(eng.runner, buckets, None, FakeGraph)
        graphs.capture()
    eng.runner.graphs = graphs
    return graphs


def run(llm: LLM, batch: list[list[int]], params: SamplingParams | list[SamplingParams] = PARAMS
        ) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params)]


def assert_same(got: list[tuple[list[int], list]], want: list[tuple[list[int], list]]) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for entry, ref in zip(lps, ref_lps, strict=True):
            assert entry.keys() == ref.keys()
            assert all(abs(entry[t] - ref[t]) < 1e-4 for t in ref)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (7 + 9 * i,), generator=g).tolist() for i in range(n)]


def test_buckets() -> None:
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(4096)[-3:] == [480, 496, 512]


def test_select_picks_the_smallest_bucket_that_fits_or_none(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    graphs = DecodeGraphs(llm.engine.runner, [1, 2, 4], verify_rows=3, graph_factory=FakeGraph)

    def pick(seqs: int, max_rows: int) -> tuple[int, int] | None:
        step = HostStep(num_tokens=seqs * max_rows, num_seqs=seqs, num_decode=seqs if max_rows == 1 else 0,
                        logit_rows=seqs, sampled=[], max_rows=max_rows)
        bucket = graphs.select(step)
        return None if bucket is None else (bucket.seqs, bucket.rows)

    assert pick(1, 1) == (1, 1)
    assert pick(3, 1) == (4, 1)
    assert pick(5, 1) is None  # larger than the largest bucket: eager
    assert pick(3, 2) == (4, 3)  # verify rows (and short chunks) up to k + 1 = 3 tokens
    assert pick(3, 3) == (4, 3)
    assert pick(2, 4) is None  # a longer chunk (prefill): eager
    assert DecodeGraphs(llm.engine.runner, [1, 2, 4], None, FakeGraph).select(
        HostStep(6, 3, 0, 3, [], 2)) is None  # no speculator: no verify buckets


def test_capture_goes_largest_first_into_one_pool(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    FakeGraph.captured = []
    graphs = with_graphs(llm)
    order = [g for g in FakeGraph.captured]
    by_graph = {id(b.graph): b.seqs for b in graphs.decode}
    assert [by_graph[id(g)] for g in order] == [8, 4, 2, 1]
    assert len({id(g.pool()) for g in order}) == 1


def test_replayed_decode_equals_eager_and_padding_writes_no_kv(model_dir: Path, attention_path: str) -> None:
    """Three sequences replay the 4-sequence bucket: one padding row, which must change no KV
    slot; tokens and log-probs equal the eager engine's."""
    batch = prompts(3)
    params = [dataclasses.replace(PARAMS, max_tokens=n) for n in (12, 6, 9)]  # 3, then 2, then 1 decode
    want = run(make_llm(model_dir), batch, params)
    llm = make_llm(model_dir)
    graphs = with_graphs(llm)
    got = run(llm, batch, params)
    assert_same(got, want)
    by_size = {b.seqs: b.replays for b in graphs.decode}
    assert by_size[4] > 0  # 3 running: padded to 4
    assert by_size[2] > 0 and by_size[1] > 0

    # One more decode step of three sequences, on its own: only their three new slots change.
    eng = llm.engine
    for i, p in enumerate(batch):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()  # the three prompts, in one step
    before = [(k.clone(), v.clone()) for k, v in eng.kv_caches]
    reqs = list(eng.scheduler.running)
    assert len(reqs) == 3 and all(r.num_output_tokens == 1 for r in reqs)
    bucket4 = next(b for b in graphs.decode if b.seqs == 4)
    replays = bucket4.replays
    positions = {r.request_id: r.num_computed_tokens for r in reqs}
    eng.step()
    bs = eng.config.block_size
    written = {eng.kv.blocks_of(rid)[pos // bs] * bs + pos % bs for rid, pos in positions.items()}
    assert bucket4.replays == replays + 1
    changed = set()
    for (k0, v0), (k1, v1) in zip(before, eng.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            diff = (old != new).flatten(2).any(-1).flatten()  # [blocks * block_size]
            changed |= set(torch.nonzero(diff).flatten().tolist())
    assert changed == written
    while eng.has_unfinished_requests():
        eng.step()


def test_async_scheduling_feeds_replayed_steps_their_tokens_on_the_device(model_dir: Path) -> None:
    """With async scheduling a replayed step's pending input ids are copied into the graph's
    input buffer from the step before's sampled tokens (workers/in_flight.py): the same tokens
    and log-probs as the eager synchronous engine."""
    batch = prompts(3)
    params = [dataclasses.replace(PARAMS, max_tokens=n) for n in (12, 6, 9)]
    want = run(make_llm(model_dir), batch, params)
    llm = make_llm(model_dir, async_scheduling=True)
    graphs = with_graphs(llm)
    assert_same(run(llm, batch, params), want)
    assert sum(b.replays for b in graphs.decode) > 0
    assert llm.engine.overlapped_steps > 0


def test_steps_that_fit_no_bucket_run_eagerly(model_dir: Path) -> None:
    """A batch larger than the largest bucket, and steps mixing prefill with decode, run
    eagerly, and the output is the eager engine's."""
    batch = prompts(3, seed=1)
    want = run(make_llm(model_dir, max_num_batched_tokens=16), batch)
    llm = make_llm(model_dir, max_num_batched_tokens=16)  # long prompts prefill in chunks beside decodes
    graphs = with_graphs(llm, buckets=[1, 2])
    eager_steps = []
    forward = llm.engine.runner.forward

    def counting(*args: Any) -> torch.Tensor:
        eager_steps.append(args[2].num_decode_seqs == args[2].num_seqs)
        return forward(*args)

    llm.engine.runner.forward = counting
    got = run(llm, batch)
    assert_same(got, want)
    assert graphs.decode[1].replays > 0 and graphs.decode[0].replays > 0
    assert any(eager_steps)  # pure decode of three: no bucket holds it
    assert not all(eager_steps)  # mixed prefill and decode steps


def test_verify_steps_replay_their_bucket(model_dir: Path) -> None:
    """With n-gram speculation (k = 3), verification steps replay the 4-row buckets and the
    greedy output is the eager engine's (and the one without speculation)."""
    if cpu_decode.load() is None:
        pytest.skip("verify buckets on CPU need the C++ decode op")
    batch = repetitive_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    spec = dict(speculative="ngram", num_speculative_tokens=3, spec_max_batch_size=8, max_model_len=256)
    want = [t for t, _ in run(make_llm(model_dir, max_model_len=256), batch, params)]
    llm = make_llm(model_dir, **spec)
    graphs = with_graphs(llm)
    assert [b.rows for b in graphs.verify] == [4] * len(graphs.decode)
    got = [t for t, _ in run(llm, batch, params)]
    assert got == want
    assert llm.engine.stats.spec_drafts > 0
    assert sum(b.replays for b in graphs.verify) > 0


def test_enforce_eager_and_cpu_without_a_stand_in_capture_nothing(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    eng = llm.engine
    eager = dataclasses.replace(eng.config, enforce_eager=True)
    assert cuda_graphs.capture(eager, eng.runner, AttentionBackend.TORCH, graph_factory=FakeGraph) is None
    graphs_on = dataclasses.replace(eng.config, enforce_eager=False)
    assert cuda_graphs.capture(graphs_on, eng.runner, AttentionBackend.TORCH) is None  # CPU: no CUDA graphs
    assert eng.runner.graphs is None  # the test suite's engines run eagerly (PDSERVE_ENFORCE_EAGER=1)


def test_triton_backend_replays_padded_buckets_and_warms_eager_variants(model_dir: Path) -> None:
    """The CUDA path's kernels (in Triton's interpreter here): padding rows (seq_len 0, slot -1)
    in a 4-sequence bucket replaying 3 sequences give the eager engine's tokens, and the eager
    warm-up over padding writes no KV."""
    pytest.importorskip("triton")
    batch = prompts(3, seed=2)
    params = [dataclasses.replace(PARAMS, max_tokens=n, logprobs=None) for n in (4, 3, 2)]
    want = run(make_llm(model_dir, attention_backend="triton", max_num_seqs=4), batch, params)
    llm = make_llm(model_dir, attention_backend="triton", max_num_seqs=4)
    eng = llm.engine
    before = [(k.clone(), v.clone()) for k, v in eng.kv_caches]
    cuda_graphs.warm_eager_kernels(eng.runner, max_num_seqs=4, max_tokens=8)
    assert all(torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(before, eng.kv_caches))
    graphs = DecodeGraphs(eng.runner, [1, 4], None, FakeGraph)
    graphs.capture()
    eng.runner.graphs = graphs
    assert [t for t, _ in run(llm, batch, params)] == [t for t, _ in want]
    assert [b.replays for b in graphs.decode] == [1, 2]  # 3, then 2 running (padded to 4), then 1


def test_no_bucket_has_more_sequences_than_the_token_buffers_hold(model_dir: Path) -> None:
    """max_num_batched_tokens below max_num_seqs: a decode bucket of B sequences needs B query rows,
    so buckets stop at the token budget (a bigger one would stage past the buffers' end)."""
    llm = make_llm(model_dir, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64)
    graphs = with_graphs(llm)
    assert [b.seqs for b in graphs.decode] == [1, 2, 4]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eager = make_llm(model_dir, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64)
    assert [t for t, _ in run(llm, prompts(3), greedy)] == [t for t, _ in run(eager, prompts(3), greedy)]
    assert sum(b.replays for b in graphs.decode) > 0


class BrokenGraph(FakeGraph):
    def capture(self, fn: Callable[[], None], pool: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_an_eager_engine(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    eng = llm.engine
    said: list[str] = []
    config = dataclasses.replace(eng.config, enforce_eager=False)
    assert cuda_graphs.capture(config, eng.runner, AttentionBackend.TORCH, said.append, BrokenGraph) is None
    assert any("capture failed" in line for line in said)
    want = run(make_llm(model_dir), prompts(2))
    assert_same(run(llm, prompts(2)), want)
