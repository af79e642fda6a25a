"""What the async-scheduling tests share: the model they run, an engine of it with async
scheduling on or off (the oracle is the synchronous one), and random prompts."""

from __future__ import annotations

from pathlib import Path

import torch
from factories import tiny_spec

from pdserve import LLM
from pdserve.workers.engine import LLMEngine

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)


def engine(model_dir: Path, async_scheduling: bool, **kw: object) -> LLMEngine:
    args: dict[str, object] = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, progress=False,
                                   async_scheduling=async_scheduling)
    args.update(kw)
    return LLM(str(model_dir), **args).engine


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]
