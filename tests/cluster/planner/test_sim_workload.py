"""The simulator's requests are the bench's: same lengths, send times and prefix sharing."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.driver import build_requests, schedule
from pdserve.cluster.bench.workloads import WorkloadKind
from pdserve.cluster.planner.sim_workload import Workload


def test_random_workload_matches_what_bench_sends() -> None:
    cfg = BenchConfig("http://sim/v1", num_requests=50, input_len=300, output_len=40, range_ratio=0.5,
                      request_rate=3.0, burstiness=0.5, seed=7)
    sim = Workload.build(cfg, 16).at_rate()
    bench = build_requests(cfg)
    _, offsets = schedule(cfg, bench, None)
    assert [(r.prompt_len, r.output_len, r.arrival) for r in sim] == \
        [(b.input_len, b.output_len, t) for b, t in zip(bench, offsets)]
    assert all(len(r.block_hashes) == r.prompt_len // 16 for r in sim)
    assert len({r.block_hashes[0] for r in sim}) == len(sim)  # nothing shared


def test_shared_prefix_groups_share_exactly_their_prefix_blocks() -> None:
    cfg = BenchConfig("http://sim/v1", workload=WorkloadKind.SHARED_PREFIX, num_requests=40, input_len=600,
                      prefix_len=500, num_prefix_groups=4, output_len=8)
    bench = build_requests(cfg)
    sim = Workload.build(cfg, 16).at_rate(2.0)
    by_prefix: dict[str, list[int]] = {}
    for i, b in enumerate(bench):
        key = b.segments[0].key
        assert key is not None
        by_prefix.setdefault(key, []).append(i)
    assert len(by_prefix) == 4
    shared = 500 // 16  # 31 full blocks of prefix; block 32 mixes prefix and the request's own tokens
    for members in by_prefix.values():
        a, b = sim[members[0]], sim[members[1]]
        assert a.block_hashes[:shared] == b.block_hashes[:shared]
        assert a.block_hashes[shared] != b.block_hashes[shared]
    firsts = {sim[m[0]].block_hashes[0] for m in by_prefix.values()}
    assert len(firsts) == 4


def test_trace_hash_ids_become_shared_blocks(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 500, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [9, 2]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = BenchConfig("http://sim/v1", workload=WorkloadKind.TRACE, trace=str(trace), block_size=512)
    w = Workload.build(cfg, 16)
    own = w.at_rate()
    assert [r.arrival for r in own] == [0.0, 0.5, 1.5]  # the trace's own timing (ms)
    a, b, c = own
    assert a.block_hashes[:64] == b.block_hashes[:64]  # hash ids 1, 2: 2 x 512 tokens = 64 blocks of 16
    assert a.block_hashes[0] != c.block_hashes[0]  # 9 then 2: a different chain from the first block
    assert w.at_rate(4.0)[-1].arrival == (3 - 1) / 4.0  # stretched to a rate, its shape kept

