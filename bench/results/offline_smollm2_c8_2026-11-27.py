"""The offline side of served_vs_offline_smollm2_2026-11-27.sh: SmolLM2, 2 torch threads,
max_num_seqs 8, 48 fresh prompts of 256 tokens (64 out, greedy, EOS ignored) timed after
16 other prompts warmed the engine (none of the timed prompts is in the prefix cache)."""

from __future__ import annotations

import time

import torch

from pdserve import LLM, SamplingParams

torch.set_num_threads(2)
MODEL = "/root/.cache/pdserve/models/gguf-SmolLM2-135M-Instruct.Q4_1-a81b0b986a7f"
llm = LLM(MODEL, max_num_seqs=8, progress=False)
g = torch.Generator().manual_seed(1)
vocab = llm.engine.model_config.vocab_size
prompts = [torch.randint(100, vocab, (256,), generator=g).tolist() for _ in range(48)]
warm = [torch.randint(100, vocab, (256,), generator=g).tolist() for _ in range(16)]
sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm.generate(warm, sp)
t = time.perf_counter()
llm.generate(prompts, sp)
print("offline-2t", round(48 * 64 / (time.perf_counter() - t), 1), "tok/s")
