"""Checkpoint loading: sharded safetensors, half-precision dtypes, config spellings."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.tiny.builder import Arch, TinyModelSpec

SPEC = tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1)
PROMPT = list(range(40, 90))


def _greedy(model_dir: Path, **kw: object) -> list[int]:
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=32, progress=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


def test_sharded_checkpoint_loads_like_the_single_file(make_model: Callable[[TinyModelSpec], Path],
                                                       tmp_path: Path) -> None:
    src = make_model(SPEC)
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="200KB")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, sharded / f.name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _greedy(sharded, dtype="float32") == _greedy(src, dtype="float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_track_transformers(make_model: Callable[[TinyModelSpec], Path], dtype: str) -> None:
    src = make_model(SPEC)
    llm = LLM(str(src), dtype=dtype, max_model_len=256, num_kv_blocks=32, progress=False)
    assert llm.engine.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].float().log_softmax(-1)
    for token, lp in out.logprobs[0].items():
        assert abs(lp - ref[token].item()) < 0.05


def test_missing_weight_is_a_clear_error(make_model: Callable[[TinyModelSpec], Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = make_model(SPEC)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj"):
        LLM(str(broken), max_model_len=256, num_kv_blocks=32, progress=False)


def test_old_style_rope_keys_parse_like_new_ones() -> None:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=True)
    scaling = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    # Llama-3.2-1B's config.json as published (transformers 4 spelling) ...
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    # ... and as transformers 5 writes it.
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old == new
    assert old.rope.rope_type == "llama3" and old.rope.theta == 500000.0 and old.head_dim == 64


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu"])
def test_an_activation_other_than_silu_is_refused(act: str) -> None:
    """The MLP is SiLU-gated whatever the config says: a config naming another loaded and ran wrong."""
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5)
    assert ModelConfig.from_hf_dict({**base, "hidden_act": "silu"}) == ModelConfig.from_hf_dict(base)
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "hidden_act": act})
