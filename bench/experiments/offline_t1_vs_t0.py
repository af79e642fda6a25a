"""What sampling at temperature 1 costs the offline engine against greedy: SmolLM2 (dtype auto,
2 threads, batch 8), 24 x 256 in / 64 out at temperature 1 then 0 in one process; the ratio of the
two is steadier than either rate (docs/performance.md "The engine's CPU step"). For an A/B of two
commits run it from a git worktree of each, alternating:

    PYTHONPATH=<checkout> python bench/experiments/offline_t1_vs_t0.py MODEL_DIR [LABEL]

It prints where pdserve came from: an editable install of another checkout must not win over
PYTHONPATH.
"""

from __future__ import annotations

import sys
import time

import torch

import pdserve
from pdserve import LLM, SamplingParams

print("pdserve from", pdserve.__file__, file=sys.stderr)
torch.set_num_threads(2)
if len(sys.argv) < 2:
    raise SystemExit(__doc__)
llm = LLM(sys.argv[1], max_num_seqs=8, progress=False)
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
print(sys.argv[2] if len(sys.argv) > 2 else "", " ".join(out), flush=True)
