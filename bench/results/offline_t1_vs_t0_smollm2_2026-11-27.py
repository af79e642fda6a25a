"""The A/B behind docs/serving-profile.md "Then no noise at all" (2026-11-27 14:50 UTC): the
offline engine on SmolLM2 (bfloat16 auto, 2 threads, batch 8), 24 x 256 in / 64 out at
temperature 1 then 0 in one process. Per side, from a git worktree of that side:

    PYTHONPATH=<checkout>:/tmp/ab/hook python bench/results/offline_t1_vs_t0_smollm2_2026-11-27.py LABEL

(/tmp/ab/hook/sitecustomize.py drops the venv's editable finder, so the checkout is what runs.)
"""

from __future__ import annotations

import sys
import time

import torch

import pdserve
from pdserve import LLM, SamplingParams

print("pdserve from", pdserve.__file__, file=sys.stderr)
torch.set_num_threads(2)
MODEL = "/root/.cache/pdserve/models/gguf-SmolLM2-135M-Instruct.Q4_1-a81b0b986a7f"
llm = LLM(MODEL, max_num_seqs=8, progress=False)
g = torch.Generator().manual_seed(0)
vocab = llm.engine.model_config.vocab_size
warm = [torch.randint(10, vocab, (256,), generator=g).tolist() for _ in range(8)]
llm.generate(warm, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, detokenize=False))
out = []
for temp in (1.0, 0.0):
    prompts = [torch.randint(10, vocab, (256,), generator=g).tolist() for _ in range(24)]
    t0 = time.perf_counter()
    res = llm.generate(prompts, SamplingParams(temperature=temp, max_tokens=64, ignore_eos=True, detokenize=False))
    dt = time.perf_counter() - t0
    out.append(f"t={temp}: {sum(len(r.outputs[0].token_ids) for r in res) / dt:.1f} tok/s")
print(sys.argv[1] if len(sys.argv) > 1 else "", " ".join(out), flush=True)
