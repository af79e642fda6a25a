"""What an engine counts, and the one snapshot of it others read.

`EngineStats` is the engine's own running tally. `EngineSnapshot` is an
immutable copy of everything outside readers want (the router's load report,
the worker's metrics), taken on the engine thread by `LLMEngine.snapshot()`:
nothing outside the engine reads its scheduler or block pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Monotonic counters since the engine started."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recomputes included)
    generation_tokens: int = 0
    preemptions: int = 0
    request_faults: int = 0  # requests failed alone: their values or logits broke their row of a step
    # Speculative decoding: verification passes, drafted tokens in them, drafts
    # the target accepted, and accepted counts by draft position (index 0: first draft).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    grammar_mask_s: float = 0.0  # seconds filling grammars' token bitmasks (structured outputs)


@dataclass(frozen=True)
class StepStats:
    """One engine step that ran the model, for step observers (worker metrics)."""

    duration_s: float
    prefill_tokens: int  # prompt tokens computed in this step
    decode_seqs: int  # sequences that decoded (or verified drafts) in this step
    scheduled_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load and counters at one instant (taken on its thread; all
    zero before the first)."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # queued, preempted, and (decode side) reserved ones whose KV has not arrived
    queued_prefill_tokens: int = 0  # prompt tokens still to compute, net of what the prefix cache will give
    free_blocks: int = 0  # KV blocks an allocation may take (cached, unreferenced ones included)
    total_blocks: int = 0
    prompt_tokens: int = 0  # prompt tokens looked up in the prefix cache (requests at their first admission)
    prompt_tokens_cached: int = 0  # of those, served from the prefix cache
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Structured outputs (workers/grammar.py): requests, grammars compiled and the seconds it
    # took, requests whose grammar was compiled already, seconds filling token bitmasks.
    constrained_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_s: float = 0.0
    grammar_cache_hits: int = 0
    grammar_mask_s: float = 0.0

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0
