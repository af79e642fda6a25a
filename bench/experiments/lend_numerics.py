"""Greedy outputs of a lending engine (workers/cpu_lending.py) whose steps switch between
1 and 2 threads (a neighbour in a thread turns busy and idle every few steps), against a
plain 1-thread engine on the same 48 random prompts (24 tokens each).

    python bench/experiments/lend_numerics.py MODEL_DIR [ngram]
"""
import random
import sys
import tempfile
import threading
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.cpu_lending import CpuLending

model = sys.argv[1]
spec = sys.argv[2] if len(sys.argv) > 2 else None
rng = random.Random(0)
prompts = [[rng.randrange(5, 200) for _ in range(rng.randrange(8, 60))] for _ in range(48)]
sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
kw = dict(num_kv_blocks=512, max_model_len=256)
if spec:
    kw["speculative"] = spec
torch.set_num_threads(1)
plain = [o.outputs[0].token_ids for o in LLM(model, **kw).generate(prompts, sp, use_tqdm=False)]
d = tempfile.mkdtemp()
llm = LLM(model, cpu_lending=d, **kw)
stop = threading.Event()
work = [True]
def neighbour():
    n = CpuLending(d, 1, 2, lambda: work[0])
    i = 0
    while not stop.is_set():
        work[0] = (i // 3) % 2 == 0
        with n:
            time.sleep(0.002)
        time.sleep(0.003)
        i += 1
t = threading.Thread(target=neighbour)
t.start()
lent = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
stop.set()
t.join()
st = llm.engine.cpu_turn.stats()
diff = sum(a != b for a, b in zip(plain, lent))
print(f"spec={spec} lending stats {st}; {diff} of {len(prompts)} differ from the plain 1-thread engine")
