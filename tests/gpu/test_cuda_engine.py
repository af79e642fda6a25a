"""The engine on a CUDA device: the tests only a GPU can run (bench/gpu_check.sh runs them
on a lent one; everywhere else they are skipped). transformers on the same device is the
oracle. Imports nothing the lent GPU image lacks (no Ray, ZeroMQ, pydantic)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import capture_logits, tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.stats import StepStats
from pdserve.workers.tiny.builder import Arch, TinyModelSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GQA = tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2)
QWEN2 = tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1)
# Qwen3: q/k normalised per head before the Triton kernel that ropes them and writes the cache.
QWEN3 = tiny_spec(Arch.QWEN3, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 29, 48, 64, 95, 120, 161][:n]
    return [torch.randint(5, vocab, (length,), generator=g).tolist() for length in lengths]


def _hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("spec", [GQA, QWEN2, QWEN3], ids=["llama-gqa", "qwen2-bias", "qwen3-qk-norm"])
def test_fp32_greedy_on_cuda_equals_transformers(spec: TinyModelSpec,
                                                 make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Triton kernels (the CUDA default) in float32: the same greedy tokens as transformers on the GPU."""
    model_dir = make_model(spec)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=512,
              progress=False)
    assert llm.engine.model.model.layers[0].self_attn.backend is AttentionBackend.TRITON
    prompts = _prompts(8, llm.engine.model_config.vocab_size, seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    hf = _hf(model_dir, torch.float32)
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=48, do_sample=False,
                              pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_bf16_prefill_logits_on_cuda_match_transformers(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """bf16 end to end: each prompt's last-position logits within bf16 noise of transformers' bf16
    logits, and the same top token wherever transformers' top two are clearly apart."""
    model_dir = make_model(GQA)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=512,
              progress=False)
    captured = capture_logits(llm)
    hf = _hf(model_dir, torch.bfloat16)
    for prompt in _prompts(8, llm.engine.model_config.vocab_size, seed=2):
        captured.clear()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        mine = captured[-1][0]
        rel = float((mine - ref).norm() / ref.norm())
        assert rel < 3e-2, f"prompt of {len(prompt)}: rel {rel:.2e}"
        top2 = ref.topk(2).values
        if float(top2[0] - top2[1]) > 0.5:
            assert int(mine.argmax()) == int(ref.argmax())


def test_cuda_graphs_change_no_greedy_token(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Decode replayed from CUDA graphs (batches padded up to their bucket) gives exactly the
    eager engine's tokens, float32, ragged batches of 1, 3 and 5."""
    model_dir = make_model(GQA)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512,
                  max_num_seqs=8, enforce_eager=eager, progress=False)
        prompts = _prompts(8, llm.engine.model_config.vocab_size, seed=3)
        outs[eager] = [[o.outputs[0].token_ids for o in llm.generate(
            prompts[:n], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))] for n in (1, 3, 5)]
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:  # the comparison is with replayed steps, not eager against eager
            assert graphs is not None and all(b.replays > 0 for b in graphs.decode if b.seqs in (1, 4, 8))
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]


def test_async_scheduling_on_cuda_equals_the_synchronous_engine(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """The next step queued before this one's tokens reach the host (the CUDA default), with CUDA
    graphs: float32 tokens, finish reasons and logprobs equal to the synchronous engine's, with
    ragged max_tokens, stop tokens, seeded sampling and a penalised request beside the rest."""
    model_dir = make_model(GQA)
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512,
                  max_num_seqs=8, async_scheduling=overlap, progress=False)
        assert llm.engine.async_scheduling is overlap
        prompts = _prompts(8, llm.engine.model_config.vocab_size, seed=4)
        params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=2) for i in range(5)]
        params += [SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[5, 6, 7, 8, 9, 10, 11, 12]),
                   SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2)]
        outs = llm.generate(prompts, params)
        results[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]
        if overlap:
            assert llm.engine.overlapped_steps > 0
        del llm
        torch.cuda.empty_cache()
    for (tokens, reason, lps), (want_tokens, want_reason, want_lps) in zip(results[True], results[False]):
        assert (tokens, reason) == (want_tokens, want_reason)
        for entry, want in zip(lps or [], want_lps or []):
            assert entry.keys() == want.keys() and all(abs(entry[t] - want[t]) < 1e-4 for t in want)


def test_fp8_linear_on_cuda_equals_the_emulated_product() -> None:
    """torch._scaled_mm with row-wise scales (Hopper) against the CPU's emulation of the same
    quantized values (workers/model/fp8.py), bf16 activations."""
    from pdserve.workers.model import fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores on this card")
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 384, bias=False).requires_grad_(False)
    q = fp8.Fp8Linear.from_linear(layer)
    x = torch.randn(7, 512).to(torch.bfloat16)
    emulated = fp8.fp8_linear(x.float(), q).float()  # CPU, float32
    on_gpu = fp8.fp8_linear(x.cuda(), q.cuda()).float().cpu()
    assert float((on_gpu - emulated).norm() / emulated.norm()) < 1e-2  # bf16 output rounding


def test_fp8_weights_on_cuda_decode_within_fp8_noise(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """`quantization="fp8"` on a bf16 model: the decoder's weights take half the bytes, and the
    logits stay within fp8 noise of bf16's."""
    model_dir = make_model(GQA)
    logits = {}
    for quantization in (None, "fp8"):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=512,
                  quantization=quantization, progress=False)
        captured = capture_logits(llm)
        for prompt in _prompts(4, llm.engine.model_config.vocab_size, seed=5):
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        logits[quantization] = [c[0] for c in captured]
        del llm
        torch.cuda.empty_cache()
    for want, got in zip(logits[None], logits["fp8"]):
        assert float((got - want).norm() / want.norm()) < 0.15


def test_an_fp8_kv_cache_on_cuda_reads_as_the_reference(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """--kv-cache-dtype fp8 with the Triton kernels (the CUDA default) and with the PyTorch
    reference over the same e4m3 cache: the same greedy tokens in float32; and within fp8 noise
    of a float32 cache's logits."""
    model_dir = make_model(GQA)
    tokens, logits = {}, {}
    for backend, kv in (("triton", "fp8"), ("torch", "fp8"), ("triton", "auto")):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=512,
                  attention_backend=backend, kv_cache_dtype=kv, progress=False)
        captured = capture_logits(llm)
        prompts = _prompts(4, llm.engine.model_config.vocab_size, seed=6)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        tokens[(backend, kv)] = [o.outputs[0].token_ids for o in outs]
        logits[(backend, kv)] = captured[0]
        del llm
        torch.cuda.empty_cache()
    assert tokens[("triton", "fp8")] == tokens[("torch", "fp8")]
    want, got = logits[("triton", "auto")], logits[("triton", "fp8")]
    assert float((got - want).norm() / want.norm()) < 0.1


def test_chunked_prefill_matches_a_synchronised_run(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A prompt of many chunks (the middle ones sample nothing, so no step ends on a read-back):
    the logits equal those of the same run with the device synchronised after every step, bit for
    bit. A staging buffer rewritten before its copy ran would make them differ. A tiny model's
    chunk takes the GPU less time than the host takes to stage the next, so every step first
    queues ~20 ms of GPU sleep: the next step's copies wait behind it while the host runs ahead."""
    model_dir = make_model(GQA)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=2048,
              max_num_batched_tokens=32, enable_prefix_caching=False, progress=False)
    eng = llm.engine
    captured: list[torch.Tensor] = []
    compute_logits = eng.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        captured.append(logits.float().clone())
        return logits

    def synchronise(_: StepStats) -> None:
        torch.cuda.synchronize()

    def busy(_: StepStats) -> None:
        torch.cuda._sleep(30_000_000)  # clock cycles: ~20 ms at H100/H200 clocks

    eng.model.compute_logits = capture  # type: ignore[method-assign]
    prompt = torch.randint(5, eng.model_config.vocab_size, (1500,), generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    eng.step_observers.append(busy)
    llm.generate([prompt.tolist()], params)
    free_running = captured[-1]
    eng.step_observers.remove(busy)
    eng.step_observers.append(synchronise)
    llm.generate([prompt.tolist()], params)
    assert torch.equal(captured[-1], free_running)


def test_memory_plan_stays_inside_gpu_memory_utilization(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Default sizing on the device: the KV pool takes what the budget leaves, and a full
    batch of long prompts then decodes without going past `gpu_memory_utilization`."""
    model_dir = make_model(GQA)
    free_before, total = torch.cuda.mem_get_info()
    others = total - free_before - torch.cuda.memory_reserved()
    util = 0.3
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=util, max_model_len=2048,
              max_num_batched_tokens=1024, max_num_seqs=16, progress=False)
    assert llm.engine.num_kv_blocks > 16 * 2048 // 16
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(5, vocab, (1500,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert torch.cuda.max_memory_reserved() + others <= util * total
