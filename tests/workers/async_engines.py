"""What the async-scheduling tests share: the model they run, an engine of it with async
scheduling on or off (the oracle is the synchronous one), random prompts, and running requests
to their ends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput

Requests = dict[str, tuple[list[int] | str, SamplingParams]]

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)


def engine(model_dir: Path, async_scheduling: bool, **kw: object) -> LLMEngine:
    args: dict[str, object] = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, progress=False,
                                   async_scheduling=async_scheduling)
    args.update(kw)
    return LLM(str(model_dir), **args).engine


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]


def run(engine: LLMEngine, requests: Requests, add_at: dict[int, Requests] | None = None,
         on_step: Callable[[LLMEngine, int], None] | None = None) -> dict[str, RequestOutput]:
    """Every request's final output, each finished once; `add_at[i]` added before step i,
    `on_step(engine, i)` called before it."""
    add_at = dict(add_at or {})
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    for i in range(2000):  # bounded: every request here ends well within it
        for rid, (prompt, params) in add_at.pop(i, {}).items():
            engine.add_request(rid, prompt, params)
        if not engine.has_unfinished_requests() and not add_at:
            break
        if on_step is not None:
            on_step(engine, i)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests() and not engine.in_flight
    return finals
