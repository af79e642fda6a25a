"""The simulator's requests: the very requests `pdserve bench` sends for the same flags.

`bench_requests` builds them with the bench's own functions (driver.build_requests
for the prompts, driver.schedule for the send times), so a simulated run and a
real `pdserve bench` run with the same seed see identical lengths, sharing and
arrivals. A prompt is reduced to what the cluster's caches see: its block hashes.

Block hashes come from the prompt's segments, not its token ids: a segment with
a key has the same tokens in every request that names it, a keyless one is the
request's own. A block's identity is the chain of (segment, offset range) runs
it covers, so two prompts share a block hash exactly when they share that
block's tokens and every block before it, as the workers' chained hashes do,
at O(blocks) cost instead of hashing every token of a long trace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.workloads import BenchRequest

_ROOT = 0x5EED  # the parent of every prompt's first block


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator sees it."""

    index: int
    arrival: float  # seconds after the run starts
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...]  # one per full `block_size`-token block of the prompt
    affinity_key: int | None  # the first block's hash (the router's rendezvous tie-break)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.index}: prompt and output must be >= 1 token, got "
                             f"{self.prompt_len} and {self.output_len}")


def block_hashes(req: BenchRequest, index: int, block_size: int) -> tuple[int, ...]:
    """The chained hash of every full `block_size`-token block of `req`'s prompt."""
    runs: list[tuple[object, int, int]] = []  # (segment identity, start, end) in prompt order
    for s, seg in enumerate(req.segments):
        ident: object = seg.key if seg.key is not None else ("own", index, s)
        runs.append((ident, 0, len(seg.token_ids)))
    out: list[int] = []
    parent = _ROOT
    block: list[tuple[object, int, int]] = []
    filled = 0
    for ident, start, end in runs:
        pos = start
        while pos < end:  # bounded: pos advances by >= 1 each turn
            take = min(end - pos, block_size - filled)
            block.append((ident, pos, pos + take))
            pos += take
            filled += take
            if filled == block_size:
                parent = hash((parent, tuple(block)))
                out.append(parent)
                block, filled = [], 0
    return tuple(out)


def to_sim(reqs: list[BenchRequest], offsets: list[float], block_size: int) -> list[SimRequest]:
    """Bench requests and their send offsets -> simulator requests (KV blocks of `block_size`)."""
    if len(reqs) != len(offsets):
        raise ValueError(f"{len(reqs)} requests but {len(offsets)} send times")
    out = []
    for i, (r, t) in enumerate(zip(reqs, offsets)):
        hashes = block_hashes(r, i, block_size)
        out.append(SimRequest(i, float(t), r.input_len, r.output_len, hashes, hashes[0] if hashes else None))
    return out


@dataclass(frozen=True)
class Workload:
    """A bench workload built once; `at_rate` sends it at any rate (a rate search
    reuses the prompts and their hashes, only the send times change)."""

    cfg: BenchConfig
    requests: tuple[BenchRequest, ...]
    block_size: int
    _base: tuple[SimRequest, ...]

    @classmethod
    def build(cls, cfg: BenchConfig, block_size: int) -> Workload:
        """The requests `pdserve bench` would send for `cfg`, for KV blocks of `block_size` tokens."""
        from pdserve.cluster.bench.driver import build_requests

        reqs = build_requests(cfg)
        base = to_sim(reqs, [0.0] * len(reqs), block_size)
        return cls(cfg, tuple(reqs), block_size, tuple(base))

    def at_rate(self, rate: float | None = None) -> list[SimRequest]:
        """Send times as the bench draws them: at `rate` (a timestamped trace stretched to it,
        its shape kept), or with None at cfg's own rate (or the trace's own timing)."""
        from pdserve.cluster.bench.driver import schedule

        _, offsets = schedule(self.cfg, list(self.requests), rate)
        return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(self._base, offsets)]

    @property
    def own_rate(self) -> float:
        """The rate the bench would report for cfg as given (inf: all at once)."""
        from pdserve.cluster.bench.driver import schedule

        return schedule(self.cfg, list(self.requests), None)[0]
