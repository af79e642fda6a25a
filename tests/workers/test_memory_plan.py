"""The GPU memory plan: the KV pool takes what is left of `gpu_memory_utilization` of the device
once other processes, the weights (target and draft), the activations of a profile step at
`max_num_batched_tokens` and memory outside torch are counted; a block costs the target's and
the draft's KV. The arithmetic is checked here as a pure function; the engine runs the whole
plan on CPU with a fake probe standing in for the CUDA one (nothing here has run on a GPU)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers import engine_setup
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine_setup import plan_kv, resolve_device
from pdserve.workers.kv.cache import DeviceMemory, bytes_per_block, kv_budget_bytes
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import TinyModelSpec

CUDA = torch.device("cuda")  # only its type is read: plan_kv allocates nothing
GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def draft_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.05, seed=7))


def llama8b(model_dir: Path) -> ModelConfig:
    """Llama-3.1-8B's KV shape and context (32 layers, 8 KV heads of 128, 131072 positions)."""
    return dataclasses.replace(ModelConfig.from_pretrained(str(model_dir)), num_layers=32, num_heads=32,
                               num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336,
                               max_position_embeddings=131072)


def test_the_budget_is_what_utilization_leaves_after_others_weights_activations_and_non_torch() -> None:
    mem = DeviceMemory(total=80 * GiB, used_by_others=2 * GiB, weights=16 * GiB, activations=3 * GiB,
                       non_torch=GiB // 2)
    assert kv_budget_bytes(mem, 0.9) == int(80 * GiB * 0.9) - int(21.5 * GiB)
    assert kv_budget_bytes(mem, 0.5) == 40 * GiB - int(21.5 * GiB)
    assert kv_budget_bytes(dataclasses.replace(mem, used_by_others=60 * GiB), 0.9) < 0


def test_plan_on_cuda_counts_utilization_others_and_the_draft(model_dir: Path, draft_dir: Path) -> None:
    cfg, draft = llama8b(model_dir), ModelConfig.from_pretrained(str(draft_dir))
    bf16 = torch.bfloat16
    per_block = bytes_per_block(cfg, 16, bf16)
    assert per_block == 2 * MiB  # 2 (K, V) * 32 layers * 16 tokens * 8 heads * 128 * 2 bytes
    mem = DeviceMemory(total=80 * GiB, used_by_others=GiB, weights=15 * GiB, activations=2 * GiB)
    cfg_09 = EngineConfig(str(model_dir), gpu_memory_utilization=0.9)
    n, max_len = plan_kv(cfg_09, cfg, bf16, CUDA, 131072, memory=mem)
    assert n == (int(80 * GiB * 0.9) - 18 * GiB) // per_block and max_len == 131072
    # Less utilization, more used by others: fewer blocks, byte for byte.
    assert plan_kv(EngineConfig(str(model_dir), gpu_memory_utilization=0.5), cfg, bf16, CUDA, 131072,
                   memory=mem)[0] == (40 * GiB - 18 * GiB) // per_block
    busy = dataclasses.replace(mem, used_by_others=11 * GiB)
    assert plan_kv(cfg_09, cfg, bf16, CUDA, 131072, memory=busy)[0] == n - 10 * GiB // per_block
    # A draft keeps a pool of as many blocks: each costs its KV too.
    with_draft = plan_kv(cfg_09, cfg, bf16, CUDA, 131072, draft=draft, memory=mem)[0]
    assert with_draft == (int(80 * GiB * 0.9) - 18 * GiB) // (per_block + bytes_per_block(draft, 16, bf16))
    assert with_draft < n
    # An explicit budget covers both pools as well; an explicit block count is taken as given.
    assert plan_kv(EngineConfig(str(model_dir), kv_cache_memory=100 * per_block), cfg, bf16, CUDA, 131072,
                   draft=cfg)[0] == 50
    assert plan_kv(EngineConfig(str(model_dir), num_kv_blocks=10_000), cfg, bf16, CUDA, 131072, draft=cfg,
                   memory=mem) == (10_000, 131072)


def test_on_cuda_a_checkpoint_context_that_does_not_fit_is_lowered_but_a_users_is_an_error(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, bf16 = llama8b(model_dir), torch.bfloat16
    # A 24 GB card with an 8B model: ~3 GiB of KV, 1,500 blocks: 24,000 of Llama-3.1's 131,072 positions.
    mem = DeviceMemory(total=24 * GiB, used_by_others=GiB // 2, weights=15 * GiB, activations=3 * GiB // 2)
    blocks = (int(24 * GiB * 0.9) - 17 * GiB) // (2 * MiB)
    with caplog.at_level(logging.WARNING):
        assert plan_kv(EngineConfig(str(model_dir)), cfg, bf16, CUDA, 131072, memory=mem) == (blocks, blocks * 16)
    assert f"serving with max_model_len {blocks * 16}" in caplog.text
    with pytest.raises(ValueError, match=r"cannot hold one max_model_len \(131072\)"):
        plan_kv(EngineConfig(str(model_dir), max_model_len=131072), cfg, bf16, CUDA, 131072, memory=mem)
    # Nothing left at all: an error that names the numbers and what to change.
    full = dataclasses.replace(mem, weights=22 * GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.9 of the device \(24.00 GiB\) leaves nothing"):
        plan_kv(EngineConfig(str(model_dir)), cfg, bf16, CUDA, 131072, memory=full)
    # CUDA without a measurement is a bug in the caller, not a guess.
    with pytest.raises(ValueError, match="measured memory"):
        plan_kv(EngineConfig(str(model_dir)), cfg, bf16, CUDA, 131072)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_asking_for_cuda_without_it_fails_at_once() -> None:
    with pytest.raises(ValueError, match="'cuda' asked for, but torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    assert engine_setup.memory_probe(torch.device("cpu")) is None


class FakeProbe:
    """Stands in for CudaMemoryProbe: torch holds `weights` whenever asked, and each profile step
    peaks `activations` above it."""

    def __init__(self, total: int, used_at_start: int, weights: int, activations: int, non_torch: int = 0) -> None:
        self.total, self.used_at_start = total, used_at_start
        self.weights, self.activations, self._non_torch = weights, activations, non_torch
        self.steps = 0  # profile steps started (reset_peak)
        self.peaks = 0  # peaks read

    def held(self) -> int:
        return self.weights

    def reset_peak(self) -> None:
        self.steps += 1

    def peak(self) -> int:
        self.peaks += 1
        return self.weights + self.activations

    def non_torch(self) -> int:
        return self._non_torch

    def empty_cache(self) -> None:
        pass


def test_the_engine_sizes_kv_from_a_profile_with_the_draft_counted(
        model_dir: Path, draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole plan as the engine runs it on CUDA, on CPU: probe first, target and draft weights,
    the profile steps (a prefill of max_num_batched_tokens over max_num_seqs sampled sequences, a
    verify step, the draft's step), then both pools of the planned size; and it serves."""
    probe = FakeProbe(total=64 * MiB, used_at_start=16 * MiB, weights=8 * MiB, activations=4 * MiB, non_torch=MiB)
    monkeypatch.setattr(engine_setup, "memory_probe", lambda device: probe)
    llm = LLM(str(model_dir), progress=False, speculative="draft", draft_model=str(draft_dir),
              num_speculative_tokens=3, spec_max_batch_size=64, max_num_seqs=16, max_num_batched_tokens=256)
    eng = llm.engine
    target, draft = ModelConfig.from_pretrained(str(model_dir)), ModelConfig.from_pretrained(str(draft_dir))
    per_block = bytes_per_block(target, 16, torch.float32) + bytes_per_block(draft, 16, torch.float32)
    assert eng.num_kv_blocks == (int(64 * MiB * 0.9) - 29 * MiB) // per_block
    assert eng.max_model_len == target.max_position_embeddings
    assert eng.spec is not None and eng.spec.proposer.kv.pool.num_blocks == eng.num_kv_blocks  # type: ignore[attr-defined]
    assert probe.steps == 2 and probe.peaks == 3  # target: prefill + verify; draft: prefill
    out = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12


def test_the_engine_serves_a_lowered_context_when_the_measured_budget_is_short(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    target = ModelConfig.from_pretrained(str(model_dir))
    per_block = bytes_per_block(target, 16, torch.float32)
    # 40 blocks left: 640 of the model's 2048 positions.
    budget = 40 * per_block + 100
    probe = FakeProbe(total=64 * MiB, used_at_start=32 * MiB - 3 * MiB - budget, weights=2 * MiB,
                      activations=MiB)
    monkeypatch.setattr(engine_setup, "memory_probe", lambda device: probe)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(model_dir), progress=False, gpu_memory_utilization=0.5, max_num_seqs=8,
                  max_num_batched_tokens=128)
    assert (llm.engine.num_kv_blocks, llm.engine.max_model_len) == (40, 640)
    assert "serving with max_model_len 640" in caplog.text
    assert probe.steps == 1 and probe.peaks == 1  # no speculation: the prefill step only
    with pytest.raises(ValueError, match=r"cannot hold one max_model_len \(1024\)"):
        LLM(str(model_dir), progress=False, gpu_memory_utilization=0.5, max_num_seqs=8,
            max_num_batched_tokens=128, max_model_len=1024)


def test_an_explicit_pool_size_needs_no_profile(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FakeProbe(total=64 * MiB, used_at_start=0, weights=0, activations=0)
    monkeypatch.setattr(engine_setup, "memory_probe", lambda device: probe)
    llm = LLM(str(model_dir), progress=False, num_kv_blocks=64, max_model_len=512)
    assert llm.engine.num_kv_blocks == 64 and probe.steps == 0
