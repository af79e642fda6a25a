"""KV pool sizing that just works: on CPU a budget that holds a real model's
context (vLLM's 4 GiB), no more than `max_num_seqs` whole sequences, and a model
whose context does not fit is served at the longest that does (said in the log),
unless the user asked for that length: then a clear error."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine_setup import plan_kv
from pdserve.workers.kv.cache import CPU_DEFAULT_KV_BYTES, bytes_per_block
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import TinyModelSpec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def smollm2_like(model_dir: Path) -> ModelConfig:
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64, 8192 positions)."""
    return dataclasses.replace(ModelConfig.from_pretrained(str(model_dir)), num_layers=30, num_heads=9,
                               num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
                               max_position_embeddings=8192)


def test_a_real_small_model_gets_its_whole_context_on_cpu_by_default(model_dir: Path) -> None:
    cfg = smollm2_like(model_dir)
    blocks, max_len = plan_kv(EngineConfig(str(model_dir)), cfg, torch.float32, CPU, 8192)
    assert max_len == 8192
    assert blocks == CPU_DEFAULT_KV_BYTES // bytes_per_block(cfg, 16, torch.float32) >= 8192 // 16
    assert CPU_DEFAULT_KV_BYTES == 4 << 30  # vLLM's CPU default


def test_the_cpu_default_holds_no_more_than_max_num_seqs_sequences(model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(str(model_dir))
    blocks, max_len = plan_kv(EngineConfig(str(model_dir), max_num_seqs=8), cfg, torch.float32, CPU, 2048)
    assert (blocks, max_len) == (8 * 2048 // 16, 2048)
    # An explicit budget is taken as given.
    budget = 3000 * bytes_per_block(cfg, 16, torch.float32)
    assert plan_kv(EngineConfig(str(model_dir), max_num_seqs=8, kv_cache_memory=budget), cfg, torch.float32, CPU,
                   2048) == (3000, 2048)


def test_a_context_that_does_not_fit_is_served_at_the_longest_that_does(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = ModelConfig.from_pretrained(str(model_dir))
    budget = 40 * bytes_per_block(cfg, 16, torch.float32) + 100  # 40 blocks: 640 of the model's 2048 positions
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(model_dir), kv_cache_memory=budget, progress=False)
    assert llm.engine.num_kv_blocks == 40 and llm.engine.max_model_len == 640
    assert "serving with max_model_len 640" in caplog.text
    ok = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[7] * 600], ok)[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="640"):
        llm.generate([[7] * 700], ok)


def test_a_length_the_user_asked_for_that_does_not_fit_is_an_error(model_dir: Path) -> None:
    cfg = ModelConfig.from_pretrained(str(model_dir))
    budget = 40 * bytes_per_block(cfg, 16, torch.float32)
    with pytest.raises(ValueError, match=r"^num_kv_blocks: 40 blocks of 16 tokens cannot hold one max_model_len "
                                         r"\(1024\)"):
        LLM(str(model_dir), kv_cache_memory=budget, max_model_len=1024, progress=False)
    with pytest.raises(ValueError, match="cannot hold one max_model_len"):
        plan_kv(EngineConfig(str(model_dir), num_kv_blocks=10, max_model_len=1024), cfg, torch.float32, CPU, 1024)
