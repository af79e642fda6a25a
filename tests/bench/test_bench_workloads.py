"""Workloads: exact lengths, shared prefixes of exactly prefix_len tokens, trace replay
(timestamps, hash_ids => identical blocks), and text that re-tokenizes exactly."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.driver import schedule
from pdserve.cluster.bench.workloads import (
    TimeUnit,
    TokenRange,
    WorkloadKind,
    load_trace,
    random_requests,
    shared_prefix_requests,
    trace_requests,
)

TOKENS = TokenRange(16, 4096)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_random_exact_lengths_and_ids_in_range() -> None:
    reqs = random_requests(50, 100, 20, 0.0, TOKENS, seed=0)
    assert [r.input_len for r in reqs] == [100] * 50
    assert [len(r.prompt_ids) for r in reqs] == [100] * 50
    assert [r.output_len for r in reqs] == [20] * 50
    assert all(16 <= t < 4096 for r in reqs for t in r.prompt_ids)
    assert random_requests(5, 10, 2, 0.0, TOKENS, seed=3) == random_requests(5, 10, 2, 0.0, TOKENS, seed=3)


def test_random_range_ratio_spans_the_symmetric_range() -> None:
    reqs = random_requests(400, 100, 20, 0.5, TOKENS, seed=0)
    ins = [r.input_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50
    assert all(len(r.prompt_ids) == r.input_len for r in reqs)


@pytest.mark.parametrize(("mean", "ratio"), [(100, 0.1), (100, 0.3), (10, 0.7)])
def test_lengths_stay_within_the_documented_range(mean: int, ratio: float) -> None:
    """100 * 1.1 is 110.00000000000001 in floats: its ceiling made 111-token prompts."""
    import numpy as np

    from pdserve.cluster.bench.workloads import sample_lengths

    lengths = sample_lengths(np.random.default_rng(0), 2000, mean, ratio)
    assert max(lengths) == round(mean * (1 + ratio)) and min(lengths) == max(1, round(mean * (1 - ratio)))


def test_shared_prefix_groups_share_exactly_prefix_len_tokens() -> None:
    reqs = shared_prefix_requests(24, num_groups=4, prefix_len=64, input_len=100, output_len=8, range_ratio=0.0,
                                  tokens=TOKENS, seed=0)
    assert [r.input_len for r in reqs] == [100] * 24
    groups: dict[str, list[list[int]]] = defaultdict(list)
    for r in reqs:
        groups[r.segments[0].key].append(r.prompt_ids)  # type: ignore[index]
    assert sorted(len(g) for g in groups.values()) == [6, 6, 6, 6]
    for members in groups.values():
        for other in members[1:]:
            assert common_prefix(members[0], other) == 64
    firsts = [g[0] for g in groups.values()]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            assert common_prefix(a, b) < 64
    # shuffled: not group after group
    keys = [r.segments[0].key for r in reqs]
    assert keys != sorted(keys)


def test_shared_prefix_must_leave_a_unique_suffix() -> None:
    with pytest.raises(ValueError, match="longer than the prefix"):
        shared_prefix_requests(4, 2, 100, 100, 8, 0.0, TOKENS, seed=0)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_hash_ids_give_identical_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [7, 8, 9]},  # 16+16+8
        {"timestamp": 1500, "input_length": 50, "output_length": 6, "hash_ids": [7, 8, 11, 12]},  # 16+16+16+2
        {"timestamp": 4000, "input_length": 20, "output_length": 7},  # no sharing
        {"timestamp": 4000, "input_length": 40, "output_length": 5, "hash_ids": [7]},  # 16 + 24 own
    ]
    reqs = trace_requests(load_trace(write_trace(tmp_path / "t.jsonl", rows), TimeUnit.MILLISECONDS), 16, TOKENS, 0)
    a, b, c, d = (r.prompt_ids for r in reqs)
    assert [len(a), len(b), len(c), len(d)] == [40, 50, 20, 40]
    assert [r.output_len for r in reqs] == [5, 6, 7, 5]
    assert a[:32] == b[:32]  # ids 7, 8 shared
    assert a[32:40] != b[32:40]  # 9 vs 11
    assert d[:16] == a[:16] and d[16:32] != a[16:32]
    assert common_prefix(c, a) == 0
    # content is a function of (seed, id): the same block whichever row names it first
    again = trace_requests([load_trace(tmp_path / "t.jsonl", TimeUnit.MILLISECONDS)[1]], 16, TOKENS, 0)[0]
    assert again.prompt_ids[:32] == b[:32]


def test_trace_partial_last_block_is_the_blocks_start(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2]}]
    full, cut = (r.prompt_ids for r in trace_requests(load_trace(write_trace(tmp_path / "t.jsonl", rows),
                                                                 TimeUnit.SECONDS), 16, TOKENS, 0))
    assert cut == full[:20]


@pytest.mark.parametrize("unit,scale", [("ms", 1e-3), ("s", 1.0)])
def test_trace_replay_honours_timestamps(tmp_path: Path, unit: str, scale: float) -> None:
    rows = [{"timestamp": t, "input_length": 4, "output_length": 2} for t in (300, 100, 700, 700)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    cfg = BenchConfig("http://x/v1", workload=WorkloadKind.TRACE, trace=str(path), trace_time_unit=TimeUnit(unit),
                      block_size=4)
    reqs = trace_requests(load_trace(path, TimeUnit(unit)), 4, TOKENS, 0)
    rate, offsets = schedule(cfg, reqs, None)
    assert offsets == pytest.approx([0.0, 200 * scale, 600 * scale, 600 * scale])  # sorted, from the first
    assert rate == pytest.approx(3 / (600 * scale))
    fast = BenchConfig("http://x/v1", workload=WorkloadKind.TRACE, trace=str(path), trace_time_unit=TimeUnit(unit),
                       trace_speedup=2.0)
    assert schedule(fast, reqs, None)[1] == pytest.approx([0.0, 100 * scale, 300 * scale, 300 * scale])
    # a sweep stretches the trace to each rate, keeping its shape
    assert schedule(cfg, reqs, 1.0)[1] == pytest.approx([0.0, 1.0, 3.0, 3.0])


def test_bad_trace_row_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        load_trace(path, TimeUnit.MILLISECONDS)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - the tiny model's byte-level BPE (trained, or read from its cache, once per module)
    from pdserve.workers.tiny.tokenizer import train_tokenizer, wrap_tokenizer

    return wrap_tokenizer(train_tokenizer(4096, progress=False))


def test_text_prompts_retokenize_to_exact_lengths_and_keep_shared_prefixes(tokenizer) -> None:  # noqa: ANN001
    from pdserve.cluster.bench.prompts import TextRenderer, usable_token_ids

    reqs = shared_prefix_requests(12, num_groups=3, prefix_len=40, input_len=70, output_len=4, range_ratio=0.2,
                                  tokens=TokenRange(16, 4000), seed=0)
    renderer = TextRenderer(tokenizer, usable_token_ids(tokenizer), seed=0)
    texts = [renderer.render(r) for r in reqs]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert [len(x) for x in ids] == [r.input_len for r in reqs]
    by_group: dict[str, list[list[int]]] = defaultdict(list)
    for r, x in zip(reqs, ids):
        by_group[r.segments[0].key].append(x)  # type: ignore[index]
    for members in by_group.values():
        assert all(m[:40] == members[0][:40] for m in members)
