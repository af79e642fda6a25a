"""Batch invariance: greedy outputs (96 tokens) of 16 random prompts run as one batch and
one at a time, one torch thread. bfloat16 on an AMX CPU is not batch-invariant; float32 is
(docs/reliability.md: why the chaos harness pins float32).

    python bench/experiments/batch_invariance.py MODEL_DIR auto|float32 [eager]
    PDSERVE_CPU_PACKED_LINEAR=0 python bench/experiments/batch_invariance.py MODEL_DIR auto
"""
import random
import sys

import torch

from pdserve import LLM, SamplingParams

model, dtype = sys.argv[1], sys.argv[2]
eager = len(sys.argv) > 3 and sys.argv[3] == "eager"
torch.set_num_threads(1)
rng = random.Random(1)
prompts = [[rng.randrange(5, 200) for _ in range(rng.randrange(8, 60))] for _ in range(16)]
sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
llm = LLM(model, dtype=dtype, enforce_eager=eager, num_kv_blocks=512, max_model_len=256)
together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:16]]
diff = sum(a != b for a, b in zip(together, alone))
print(f"dtype={llm.engine.dtype} eager={eager}: {diff} of {len(alone)} differ, batch 16 vs batch 1")
