"""What to send: prompts of exact token lengths, with the sharing each workload asks for.

A prompt is a chain of `Segment`s. A segment with a key has the same tokens
in every request that names that key (a shared-prefix group's prefix, a trace
block), so prefix sharing is explicit and the text renderer (prompts.py) can
keep it exact at the token level. A segment without a key is this request's
own.

Token ids are drawn uniformly from a `TokenRange`, seeded: with no tokenizer
at hand the ids are sent as-is (`prompt: [int, ...]`), so the server sees
exactly these lengths.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np


class WorkloadKind(str, Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    TRACE = "trace"


class TimeUnit(str, Enum):
    SECONDS = "s"
    MILLISECONDS = "ms"  # Mooncake traces

    @property
    def seconds(self) -> float:
        return 1.0 if self is TimeUnit.SECONDS else 1e-3


@dataclass(frozen=True)
class TokenRange:
    """Ids in [lo, hi): keep them inside the vocabulary and clear of special tokens."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"token id range: need 0 <= lo < hi, got {self.lo}:{self.hi}")

    def sample(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(self.lo, self.hi, size=n))


@dataclass(frozen=True)
class Segment:
    key: str | None  # same key => same tokens in every request; None => this request's own
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BenchRequest:
    segments: tuple[Segment, ...]
    output_len: int
    timestamp: float | None = None  # trace replay: seconds after the trace's first request

    @property
    def prompt_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def input_len(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


def sample_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)] (vLLM's symmetric range), at least 1."""
    if mean < 1:
        raise ValueError(f"length: must be >= 1, got {mean}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio: must be in [0, 1), got {range_ratio}")
    # Rounded first: 100 * 1.1 is 110.00000000000001 in floats, whose ceiling (111) is past the range.
    lo = max(1, math.floor(round(mean * (1 - range_ratio), 9)))
    hi = max(lo, math.ceil(round(mean * (1 + range_ratio), 9)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, tokens: TokenRange,
                    seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = sample_lengths(rng, n, input_len, range_ratio)
    outs = sample_lengths(rng, n, output_len, range_ratio)
    return [BenchRequest((Segment(None, tokens.sample(rng, i)),), o) for i, o in zip(ins, outs)]


def shared_prefix_requests(n: int, num_groups: int, prefix_len: int, input_len: int, output_len: int,
                           range_ratio: float, tokens: TokenRange, seed: int) -> list[BenchRequest]:
    """`num_groups` random prefixes of `prefix_len` tokens; request i is in group i % num_groups,
    then the order is shuffled (seeded) so a group's requests do not arrive back to back.

    `input_len` is the whole prompt: prefix + a unique suffix of at least one token.
    """
    if num_groups < 1 or prefix_len < 1:
        raise ValueError(f"shared-prefix: need num_prefix_groups >= 1 and prefix_len >= 1, "
                         f"got {num_groups} and {prefix_len}")
    rng = np.random.default_rng(seed)
    ins = sample_lengths(rng, n, input_len, range_ratio)
    if ins and min(ins) <= prefix_len:
        raise ValueError(f"shared-prefix: every prompt must be longer than the prefix ({prefix_len} tokens); "
                         f"--input-len/--range-ratio allow {min(ins)}")
    outs = sample_lengths(rng, n, output_len, range_ratio)
    prefixes = [Segment(f"prefix-{g}", tokens.sample(rng, prefix_len)) for g in range(num_groups)]
    reqs = [BenchRequest((prefixes[i % num_groups], Segment(None, tokens.sample(rng, ins[i] - prefix_len))), outs[i])
            for i in range(n)]
    order = rng.permutation(n)
    return [reqs[int(i)] for i in order]


@dataclass(frozen=True)
class TraceRow:
    timestamp: float | None  # seconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def load_trace(path: str | Path, unit: TimeUnit) -> list[TraceRow]:
    """JSONL rows {timestamp, input_length, output_length, hash_ids?}, sorted by timestamp (stable)."""
    rows: list[TraceRow] = []
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the `with` below
    except OSError as e:  # a traceback out of `pdserve bench` (exit 1), where a bad flag is one line (exit 2)
        raise ValueError(f"trace: cannot read {path}: {e.strerror or e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ts = d.get("timestamp")
                rows.append(TraceRow(None if ts is None else float(ts) * unit.seconds, int(d["input_length"]),
                                     int(d["output_length"]), tuple(int(h) for h in d.get("hash_ids") or ())))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad trace row ({e!r}): {line.strip()[:200]}") from None
    stamped = sum(r.timestamp is not None for r in rows)
    if stamped not in (0, len(rows)):
        raise ValueError(f"{path}: {stamped} of {len(rows)} rows have a timestamp: give all or none")
    if stamped:
        rows.sort(key=lambda r: r.timestamp)  # type: ignore[arg-type, return-value]
    return rows


def trace_requests(rows: list[TraceRow], block_size: int, tokens: TokenRange, seed: int) -> list[BenchRequest]:
    """One request per row. hash_ids[j] names the j-th `block_size`-token block of the prompt:
    the same id is the same tokens in every request, so the trace's prefix sharing is
    reproduced (Mooncake's convention). A last block cut short by input_length keeps its
    id's first tokens; tokens past the hashed blocks are the request's own."""
    if block_size < 1:
        raise ValueError(f"block size: must be >= 1, got {block_size}")
    rng = np.random.default_rng(seed)
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        if h not in blocks:  # content depends on (seed, id) only, not on which row names it first
            blocks[h] = tokens.sample(np.random.default_rng([seed, h & 0xFFFFFFFFFFFFFFFF]), block_size)
        return blocks[h]

    t0 = rows[0].timestamp if rows and rows[0].timestamp is not None else None
    out: list[BenchRequest] = []
    for r in rows:
        if r.input_length < 1 or r.output_length < 1:
            raise ValueError(f"trace: input_length and output_length must be >= 1, got {r}")
        segs: list[Segment] = []
        left = r.input_length
        for h in r.hash_ids:
            if left == 0:
                break
            k = min(block_size, left)
            segs.append(Segment(f"block-{h}" if k == block_size else f"block-{h}[:{k}]", block(h)[:k]))
            left -= k
        if left:
            segs.append(Segment(None, tokens.sample(rng, left)))
        ts = None if t0 is None or r.timestamp is None else r.timestamp - t0
        out.append(BenchRequest(tuple(segs), r.output_length, ts))
    return out
