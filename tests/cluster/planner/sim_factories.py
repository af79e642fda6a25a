"""A synthetic profile whose points lie exactly on the cost models' shapes, so the fitted
costs are known in closed form and the simulator can be checked against oracles."""

from __future__ import annotations

from pdserve.cluster.planner.profile import (
    DecodePoint,
    EngineShape,
    PrefillPoint,
    Profile,
    SpecProfile,
    TransferPoint,
)

PREFILL = (0.002, 1e-5, 1e-9)  # a, per new token, per new token x attended token
DECODE = (0.005, 2e-4, 1e-7)  # a, per row, per row x context token
TRANSFER = (0.001, 1e-9)  # a, seconds per byte
KV_BYTES_PER_TOKEN = 4096


def synthetic_profile(block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                      num_kv_blocks: int = 4096, tokens_per_step: float | None = None) -> Profile:
    pa, pb, pc = PREFILL
    da, db, dc = DECODE
    ta, tb = TRANSFER
    pre = [PrefillPoint(n, c, pa + pb * n + pc * n * (c + n / 2))
           for n, c in [(128, 0), (512, 0), (1024, 0), (512, 512), (2048, 0)]]
    dec = [DecodePoint(b, x, da + db * b + dc * b * x) for b, x in [(1, 128), (8, 512), (32, 1024), (64, 2048)]]
    tr = [TransferPoint(n, ta + tb * n) for n in (100_000, 1_000_000, 10_000_000)]
    spec = None if tokens_per_step is None else SpecProfile("ngram", 3, 0.5, tokens_per_step)
    engine = EngineShape(block_size, max_num_seqs, max_num_batched_tokens, num_kv_blocks, 8192, 2, "float32", "cpu")
    return Profile({"cpu": "synthetic"}, {"name": "synthetic"}, engine, "tcp", KV_BYTES_PER_TOKEN, tuple(pre),
                   tuple(dec), tuple(tr), speculative=spec)


def unique_requests(arrivals: list[float], prompt_len: int, output_len: int, block_size: int = 16) -> list:
    """Requests that share no prompt block, sent at `arrivals`."""
    from pdserve.cluster.planner.sim_workload import SimRequest

    out = []
    for i, t in enumerate(arrivals):
        hashes = tuple(hash(("req", i, j)) for j in range(prompt_len // block_size))
        out.append(SimRequest(i, t, prompt_len, output_len, hashes, hashes[0] if hashes else None))
    return out
