"""The Triton backend end to end in the engine (interpreter on CPU), and backend choice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.tiny.builder import TinyModelSpec


def test_tiny_model_greedy_with_triton_equals_torch(make_model: Callable[[TinyModelSpec], Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend's model (its fused RoPE + KV write and SiLU x mul, counted) gives
    the torch backend's greedy tokens."""
    from pdserve.kernels import triton_act, triton_attention

    calls = {"rope_kv": 0, "silu_mul": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(triton_attention, "rope_and_write_kv", counted("rope_kv", triton_attention.rope_and_write_kv))
    monkeypatch.setattr(triton_act, "silu_and_mul", counted("silu_mul", triton_act.silu_and_mul))
    model_dir = make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05, rope_scaling="llama3"))
    g = torch.Generator().manual_seed(0)
    # Ragged prompts, one longer than a block, one shorter; a small token budget
    # makes the second step mix a decode row with a prefill chunk.
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (21, 6, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        # float32 on a GPU too (dtype auto would be bf16 there, where greedy ties may differ by backend)
        llm = LLM(str(model_dir), attention_backend=backend, dtype="float32", max_model_len=128, num_kv_blocks=32,
                  max_num_batched_tokens=32, progress=False)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
    assert len(set(outs["torch"][0])) > 1
    assert calls["rope_kv"] > 0 and calls["silu_mul"] > 0


def test_auto_backend_is_reference_on_cpu_and_triton_on_cuda() -> None:
    assert AttentionBackend.AUTO.resolve(torch.device("cpu")) is AttentionBackend.TORCH
    assert AttentionBackend.AUTO.resolve(torch.device("cuda")) is AttentionBackend.TRITON
    assert AttentionBackend("torch").resolve(torch.device("cuda")) is AttentionBackend.TORCH


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM("/nonexistent", attention_backend="flash")
