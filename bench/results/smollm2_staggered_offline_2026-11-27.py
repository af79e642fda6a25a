"""Offline SmolLM2-135M, 8 requests in flight, 256 in / 64 out, 2 torch threads: waves (LLM.generate:
the 8 of a wave start and end together) against staggered arrivals (as served requests come), alternating.
The experiment behind a paragraph of docs/serving-profile.md; run from the repo root:

    python bench/results/smollm2_staggered_offline_2026-11-27.py [MODEL]
"""

from __future__ import annotations

import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.model.default_model import default_model

torch.set_num_threads(2)
model = sys.argv[1] if len(sys.argv) > 1 else str(default_model(progress=True))
llm = LLM(model, max_num_seqs=8, progress=False)
eng = llm.engine
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(10, eng.model_config.vocab_size, (256,), generator=gen).tolist() for _ in range(64)]


def params(n: int = 64) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)


def waves() -> float:
    t0 = time.perf_counter()
    llm.generate(prompts[8:56], params())
    return 48 * 64 / (time.perf_counter() - t0)


def staggered() -> float:
    """8 in flight; the first 8 ask for 8, 16, ... 64 tokens, so later arrivals are spread out."""
    t0, tokens, started, rid = time.perf_counter(), 0, 0, 0
    for i in range(8):
        eng.add_request(f"s{rid}", prompts[8 + i], params(8 * (i + 1)))
        rid += 1
    live = 8
    while live:
        for out in eng.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                live -= 1
                if started < 40:
                    eng.add_request(f"s{rid}", prompts[16 + started], params())
                    rid, started, live = rid + 1, started + 1, live + 1
    return tokens / (time.perf_counter() - t0)


llm.generate(prompts[:8], params())  # warm-up
for run in (waves, staggered, waves, staggered):
    print(run.__name__, round(run(), 1), "tok/s", flush=True)
