"""The simulator's per-request state: the engine settings it runs under, a request on one
worker (`Seq`: a handoff has one on each side), and what its client sees (`Track`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from pdserve.cluster.planner.sim_kv import SeqBlocks
from pdserve.cluster.planner.sim_workload import SimRequest


@dataclass(frozen=True)
class EngineSettings:
    """The engine knobs the simulator honours (from the profile's EngineShape, or overridden)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    enable_prefix_caching: bool = True
    tokens_per_step: float = 1.0  # a decoding sequence's tokens per step (speculative decoding: > 1)
    row_tokens: int = 1  # budget tokens one decode row takes (1 + drafts verified)
    max_model_len: int | None = None  # longer prompt + max_tokens: refused (400), as workers/inputs.py does

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "row_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"engine: max_model_len must be >= 2, got {self.max_model_len}")
        if not self.tokens_per_step >= 1.0:
            raise ValueError(f"engine: tokens_per_step must be >= 1, got {self.tokens_per_step}")


class SeqKind(enum.Enum):
    FULL = "full"  # prefills and decodes here (colocated, local prefill, prefill-only)
    PREFILL_ORDER = "prefill_order"  # prefills here; its KV then moves to a decode worker
    REMOTE = "remote"  # decodes here; its prompt's KV comes from a prefill worker


@dataclass(eq=False)
class Track:
    """What the client sees of one request: every token chunk's time (floats or arrays of them)."""

    req: SimRequest
    first: float | None = None
    done: float | None = None
    chunks: list[float | np.ndarray] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the prefilling worker took from its cache
    plan: str = ""
    rejected: str | None = None  # why the gateway refused it (the bench's error), else None

    def emit(self, t: float) -> None:
        if self.first is None:
            self.first = t
        self.chunks.append(t)

    def chunk_times(self) -> np.ndarray:
        return np.concatenate([np.atleast_1d(np.asarray(c, dtype=float)) for c in self.chunks]) if self.chunks \
            else np.zeros(0)


@dataclass(eq=False)
class Seq:
    """A request on one worker (a handoff has one on each side)."""

    track: Track
    kind: SeqKind
    target: int  # tokens to compute before it samples (the prompt; prompt + outputs after a preemption)
    computed: int = 0
    generated: float = 0.0  # output tokens so far (fractional with speculative decoding)
    pending: int = 0  # prefill tokens it adds to the worker's queued_prefill_tokens
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    counted_cache: bool = False
    peer: Seq | None = None  # a prefill order's decode-side sequence

    @property
    def req(self) -> SimRequest:
        return self.track.req

    @property
    def decoding(self) -> bool:
        return self.computed >= self.target

    @property
    def context(self) -> float:
        return self.track.req.prompt_len + self.generated
