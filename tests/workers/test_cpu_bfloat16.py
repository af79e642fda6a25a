"""bfloat16 on CPU: what `dtype="auto"` picks where the CPU computes it natively
(workers/cpu_features.py), checked against transformers in bfloat16 (the oracle), and the
choice itself on CPUs with and without the instructions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import capture_logits, tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers import cpu_features
from pdserve.workers.config import DType
from pdserve.workers.engine_setup import resolve_model_dtype
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import Arch

GQA = tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2)

XEON_FLAGS = "fpu vme sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile"
ZEN3_FLAGS = "fpu vme sse2 avx2 fma"


@pytest.mark.parametrize(("flags", "want"), [(XEON_FLAGS, torch.bfloat16), (ZEN3_FLAGS, torch.float32),
                                              ("fpu avx512f avx512_bf16", torch.bfloat16)])
def test_auto_picks_bfloat16_only_where_the_cpu_has_it(tmp_path: Path, flags: str, want: torch.dtype) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    native = cpu_features.has_native_bf16(str(info))
    assert native is (want == torch.bfloat16)


def test_auto_on_cpu_follows_the_flags_and_an_explicit_dtype_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(arch="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=128,
                      tie_word_embeddings=False, attention_bias=False)
    cpu = torch.device("cpu")
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr("pdserve.workers.engine_setup.has_native_bf16", lambda native=native: native)
        assert resolve_model_dtype(DType.AUTO, cfg, cpu) is want
        assert resolve_model_dtype(DType.FLOAT32, cfg, cpu) is torch.float32


def test_an_unreadable_cpuinfo_means_float32(tmp_path: Path) -> None:
    assert cpu_features.has_native_bf16(str(tmp_path / "missing")) is False


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 17, 48, 95)]


def test_bfloat16_logits_on_cpu_match_transformers_in_bfloat16(
        make_model: Callable[..., Path]) -> None:
    """Prefill and every decode step (teacher-forced on transformers' greedy tokens) give logits
    within bfloat16 noise of transformers' bfloat16 logits, and the same top token wherever
    transformers' top two are clearly apart: the paged decode op, the compiled layers and the
    sampler all work in bfloat16 on CPU."""
    model_dir = make_model(GQA)
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=256, progress=False)
    assert llm.engine.dtype == torch.bfloat16
    captured = capture_logits(llm)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    steps = 8
    for prompt in _prompts(llm.engine.model_config.vocab_size):
        captured.clear()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
        tokens = out[0].outputs[0].token_ids
        assert len(captured) == steps
        with torch.no_grad():  # transformers on the same tokens: every position's logits at once
            ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        for i, mine in enumerate(captured):
            rel = float((mine[0] - ref[i]).norm() / ref[i].norm())
            assert rel < 3e-2, f"prompt of {len(prompt)}, step {i}: rel {rel:.2e}"
            top2 = ref[i].topk(2).values
            if float(top2[0] - top2[1]) > 0.5:
                assert int(mine[0].argmax()) == int(ref[i].argmax()), (len(prompt), i)


def test_the_environment_sets_the_default_dtype_and_a_bad_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.workers.config import EngineConfig

    monkeypatch.setenv("PDSERVE_DTYPE", "bfloat16")
    assert EngineConfig(model="m").dtype is DType.BFLOAT16
    assert EngineConfig(model="m", dtype="float32").dtype is DType.FLOAT32  # an explicit setting wins
    monkeypatch.delenv("PDSERVE_DTYPE")
    assert EngineConfig(model="m").dtype is DType.AUTO
    monkeypatch.setenv("PDSERVE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="dtype: must be one of"):
        EngineConfig(model="m")
