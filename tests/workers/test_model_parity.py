"""The engine's model against transformers, the oracle, on tiny random models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import Arch, TinyModelSpec

CASES = {
    "llama-gqa": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2),
    "llama-mha": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=4),
    # Larger init: with tied embeddings at std 0.02 greedy just repeats the last token.
    "qwen2-bias-tied": tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1),
    "mistral": tiny_spec(Arch.MISTRAL, hidden_size=128, num_heads=8, num_kv_heads=2),
    "llama3-rope": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=1, rope_scaling="llama3"),
}


def _hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 29, 48, 64, 95, 120, 161][:n]
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for length in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_for_prefill_and_32_decode_steps(case: str,
                                                                   make_model: Callable[[TinyModelSpec], Path]) -> None:
    model_dir = make_model(CASES[case])
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=512, progress=False)
    captured: list[torch.Tensor] = []
    compute_logits = llm.engine.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        captured.append(logits.clone())
        return logits

    llm.engine.model.compute_logits = capture  # type: ignore[method-assign]
    prompt = _prompts(8, llm.engine.model_config.vocab_size)[5]  # 95 tokens: several blocks plus a partial one
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))[0]
    generated = out.outputs[0].token_ids
    assert len(captured) == 33  # the prefill, then 32 decode steps

    # Teacher-forced oracle: one transformers forward over prompt + generated tokens.
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor([prompt + generated[:-1]])).logits[0]
    ref_steps = ref[len(prompt) - 1 :]
    for step, logits in enumerate(captured):
        err = (logits[0] - ref_steps[step]).abs().max().item()
        assert err <= 1e-4, f"step {step}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("case", ["llama-gqa", "llama-mha", "qwen2-bias-tied"])
def test_batched_greedy_equals_transformers_generate(case: str, make_model: Callable[[TinyModelSpec], Path]) -> None:
    model_dir = make_model(CASES[case])
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=512, progress=False)
    prompts = _prompts(8, llm.engine.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    hf = _hf(model_dir)
    hf.generation_config.eos_token_id = None  # match ignore_eos: always 64 new tokens
    for prompt, out in zip(prompts, outs):
        assert len(set(out.outputs[0].token_ids)) > 8, "degenerate continuation: the comparison would prove little"
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
