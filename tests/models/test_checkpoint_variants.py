"""Config variants real checkpoints ship, against transformers (the oracle), on tiny random models.

Each test writes an HF directory the way `save_pretrained` does, then edits config.json where a
real release spells things otherwise (legacy `rope_scaling`/`rope_theta`, no dtype, ...).
transformers loads the very same files, so whatever it computes is the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import capture_logits
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec, make_tiny_model

VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model directory whose tokenizer files every variant copies."""
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "m", TinyModelSpec(num_layers=1, hidden_size=64,
                                                                                 num_heads=2, num_kv_heads=1),
                           progress=False)


def _write(out: Path, tok_dir: Path, arch: str, *, edit: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
           gen: dict[str, Any] | None = None, save_dtype: torch.dtype = torch.float32, shard: str | None = None,
           bias_std: float = 0.05, **cfg: Any) -> Path:
    import transformers

    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[arch]
    base: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                initializer_range=0.05, bos_token_id=0, eos_token_id=1, pad_token_id=4)
    base.update(cfg)
    config = getattr(transformers, cls)(**base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * bias_std)
            if name.endswith("norm.weight"):  # not all ones: a norm loaded wrong must show
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    model = model.to(save_dtype)
    kw: dict[str, Any] = {"safe_serialization": True}
    if shard:
        kw["max_shard_size"] = shard
    model.save_pretrained(str(out), **kw)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    path = out / "config.json"
    raw = json.loads(path.read_text())
    for k in drop:
        raw.pop(k, None)
    raw.update(edit or {})
    path.write_text(json.dumps(raw, indent=2))
    if gen is not None:
        (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n,), generator=g).tolist()


def _hf(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _compare(model_dir: Path, prompt_len: int = 40, new: int = 12, max_model_len: int = 256, tol: float = 1e-4,
             **llm_kw: Any) -> None:
    """pdserve's greedy tokens and every step's logits equal transformers' teacher-forced ones."""
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=max(64, max_model_len // 16 + 8),
              max_model_len=max_model_len, progress=False, **llm_kw)
    try:
        captured = capture_logits(llm)
        prompt = _prompt(prompt_len)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))[0]
        got = out.outputs[0].token_ids
    finally:
        llm.close()
    hf = _hf(model_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + got[:-1]])).logits[0][len(prompt) - 1:]
        ref_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(prompt):].tolist()
    errs = [(logits[0] - ref[i]).abs().max().item() for i, logits in enumerate(captured)]
    assert max(errs) <= tol, f"max |logit diff| per step vs transformers: {[f'{e:.2e}' for e in errs]}"
    assert got == ref_tokens, f"greedy tokens differ from transformers: {got} != {ref_tokens}"


# ---- variants expected to load and match ---------------------------------------------------------------

def test_llama_linear_rope_legacy_keys(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "llama", rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                                        "rope_theta": 10000.0})
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    (d / "config.json").write_text(json.dumps(raw))
    _compare(d, prompt_len=100)


def test_llama31_rope_legacy_keys(tmp_path: Path, tokenizer_dir: Path) -> None:
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            "rope_type": "llama3"}
    d = _write(tmp_path / "m", tokenizer_dir, "llama", rope_parameters={**rope, "rope_theta": 10000.0})
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling=rope)
    (d / "config.json").write_text(json.dumps(raw))
    _compare(d, prompt_len=100)


def test_explicit_head_dim_not_hidden_over_heads(tmp_path: Path, tokenizer_dir: Path) -> None:
    # Mistral-Nemo: head_dim 128 with hidden 5120 and 32 heads.
    d = _write(tmp_path / "m", tokenizer_dir, "mistral", head_dim=48, sliding_window=None,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    _compare(d)


def test_llama_tied_embeddings_without_lm_head(tmp_path: Path, tokenizer_dir: Path) -> None:
    # Llama 3.2 1B/3B: tie_word_embeddings true, no lm_head.weight in the file.
    d = _write(tmp_path / "m", tokenizer_dir, "llama", tie_word_embeddings=True, initializer_range=0.1)
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as st:
        assert "lm_head.weight" not in st.keys()
    _compare(d)


def test_qwen2_window_set_but_unused(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "qwen2", sliding_window=16, use_sliding_window=False,
               max_window_layers=1, tie_word_embeddings=False)
    _compare(d, prompt_len=40)


@pytest.mark.parametrize("tied, eager", [(True, False), (False, True)])
def test_qwen3_matches_transformers(tmp_path: Path, tokenizer_dir: Path, tied: bool, eager: bool) -> None:
    """Qwen3 (dense): per-head RMSNorm on q and k before RoPE, no q/k/v biases, an explicit head_dim
    (48 here, not hidden / heads = 32), GQA; every norm's weight not all ones. Compiled and eager."""
    d = _write(tmp_path / "m", tokenizer_dir, "qwen3", head_dim=48, tie_word_embeddings=tied,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as st:
        names = set(st.keys())
    assert "model.layers.0.self_attn.q_norm.weight" in names and not any(n.endswith(".bias") for n in names)
    _compare(d, enforce_eager=eager)


def test_qwen3_attention_bias_biases_q_k_v_and_o(tmp_path: Path, tokenizer_dir: Path) -> None:
    """attention_bias true (no released Qwen3 sets it): transformers biases q, k, v and o_proj."""
    d = _write(tmp_path / "m", tokenizer_dir, "qwen3", attention_bias=True, tie_word_embeddings=False)
    _compare(d, enforce_eager=True)


def test_odd_rms_norm_eps(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "llama", rms_norm_eps=0.3)
    _compare(d)


def test_sharded_bf16_without_dtype(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "qwen2", save_dtype=torch.bfloat16, shard="300KB",
               drop=("dtype", "torch_dtype"), tie_word_embeddings=False)
    assert (d / "model.safetensors.index.json").is_file()
    _compare(d)


# ---- variants pdserve cannot run: must be refused at load ----------------------------------------------

def _refused_at_load(model_dir: Path, match: str, **kw: Any) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=64, progress=False, **kw).close()


def test_llama_attention_and_mlp_biases(tmp_path: Path, tokenizer_dir: Path) -> None:
    """transformers' Llama with attention_bias biases q, k, v and o_proj, with mlp_bias gate, up
    and down: both were refused at load. Greedy tokens and logits equal transformers'."""
    d = _write(tmp_path / "m", tokenizer_dir, "llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as st:
        names = set(st.keys())
    assert {f"model.layers.0.{n}.bias" for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")} <= names
    _compare(d, enforce_eager=True)


def test_mistral_attention_bias_is_ignored_as_transformers_ignores_it(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "mistral")
    raw = json.loads((d / "config.json").read_text())
    raw["attention_bias"] = True  # transformers' Mistral has no biases: the key means nothing there
    (d / "config.json").write_text(json.dumps(raw))
    _compare(d)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
     "original_max_position_embeddings": 128},
])
def test_unsupported_rope_scaling_refused(tmp_path: Path, tokenizer_dir: Path, scaling: dict[str, Any]) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "qwen2", tie_word_embeddings=False)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=10000.0, rope_scaling=scaling)
    (d / "config.json").write_text(json.dumps(raw))
    _refused_at_load(d, "rope")


def test_mistral_window_shorter_than_prompt(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "mistral", sliding_window=16)
    _refused_at_load(d, "max_model_len", max_model_len=256)
    llm = LLM(str(d), dtype="float32", num_kv_blocks=64, progress=False)
    try:
        assert llm.engine.max_model_len <= 16
        with pytest.raises(ValueError):
            llm.generate([_prompt(40)], SamplingParams(temperature=0.0, max_tokens=4))
        # Within the window the output is transformers'.
    finally:
        llm.close()
    _compare(d, prompt_len=10, new=5, max_model_len=16)


def test_prompt_longer_than_max_position_embeddings(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "llama", max_position_embeddings=32)
    _refused_at_load(d, "max_model_len", max_model_len=256)
    llm = LLM(str(d), dtype="float32", num_kv_blocks=64, progress=False)
    try:
        with pytest.raises(ValueError):
            llm.generate([_prompt(40)], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        llm.close()


def test_eos_list_in_generation_config_stops_like_transformers(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "llama")
    prompt = _prompt(30)
    hf = _hf(d)
    with torch.no_grad():
        free = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(prompt):].tolist()
    stop = free[5]
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, stop, 2]}))
    hf = _hf(d)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt):]
    llm = LLM(str(d), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False)
    try:
        got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids
    finally:
        llm.close()
    assert list(got) == ref.tolist(), (got, ref.tolist())


def test_mistral_without_sliding_window_key(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A Mistral config.json with no `sliding_window` key: transformers' MistralConfig default (4096) applies."""
    d = _write(tmp_path / "m", tokenizer_dir, "mistral", sliding_window=4096, max_position_embeddings=8192,
               drop=("sliding_window",))
    assert _hf(d).config.sliding_window == 4096  # the oracle windows at 4096
    # pdserve must window (or refuse) a prompt past 4096 tokens too.
    llm = LLM(str(d), dtype="float32", num_kv_blocks=300, progress=False)
    try:
        refused = llm.engine.max_model_len <= 4096
    finally:
        llm.close()
    if not refused:
        _compare(d, prompt_len=4110, new=3, max_model_len=4200, tol=1e-3)


def test_llama3_rope_without_original_max_position_embeddings(tmp_path: Path, tokenizer_dir: Path) -> None:
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_type": "llama3"}
    d = _write(tmp_path / "m", tokenizer_dir, "llama", max_position_embeddings=64,
               rope_parameters={**rope, "rope_theta": 10000.0, "original_max_position_embeddings": 64})
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling=rope)
    (d / "config.json").write_text(json.dumps(raw))
    _compare(d, prompt_len=40, new=8, max_model_len=64)


def test_qwen2_sliding_window_in_use(tmp_path: Path, tokenizer_dir: Path) -> None:
    d = _write(tmp_path / "m", tokenizer_dir, "qwen2", sliding_window=16, use_sliding_window=True,
               max_window_layers=1, tie_word_embeddings=False)
    _refused_at_load(d, "max_model_len", max_model_len=256)
    _compare(d, prompt_len=10, new=5, max_model_len=16)


@pytest.mark.parametrize("arch,extra", [
    ("Qwen3MoeForCausalLM", {"model_type": "qwen3_moe"}),
    ("Gemma2ForCausalLM", {"model_type": "gemma2"}),
    ("Phi3ForCausalLM", {"model_type": "phi3"}),
    ("Qwen2ForCausalLM", {"model_type": "qwen2", "mlp_bias": True}),
    ("LlamaForCausalLM", {"model_type": "llama", "hidden_act": "gelu"}),
])
def test_unsupported_layouts_refused_by_config(arch: str, extra: dict[str, Any]) -> None:
    from pdserve.workers.model.config import ModelConfig
    hf = dict(architectures=[arch], vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, **extra)
    with pytest.raises(ValueError):
        ModelConfig.from_hf_dict(hf)


def test_tied_config_but_checkpoint_has_its_own_lm_head(tmp_path: Path, tokenizer_dir: Path) -> None:
    """tie_word_embeddings=true, yet the file carries an lm_head.weight that differs from the embedding (a
    fine-tune that trained the head untied and kept the config): transformers does NOT tie then, it uses the
    file's lm_head (modeling_utils.tie_weights: "both are present in the checkpoints with different values,
    so we will NOT tie them"). pdserve must do the same or refuse; it drops the file's head silently."""
    from safetensors.torch import load_file, save_file
    d = _write(tmp_path / "m", tokenizer_dir, "llama", tie_word_embeddings=True)
    sd = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    sd["lm_head.weight"] = torch.randn(sd["model.embed_tokens.weight"].shape, generator=g) * 0.05
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _compare(d)


def test_sliding_windows_are_the_ones_transformers_applies() -> None:
    """The window pdserve caps the context at, key by key as transformers reads it: Mistral's
    defaults to 4096, Llama has none, Qwen2's applies only where a layer slides."""
    from pdserve.workers.model.config import ModelConfig

    base = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=100)

    def window(arch: str, **kw: Any) -> int | None:
        return ModelConfig.from_hf_dict({**base, "model_type": arch, **kw}).sliding_window

    assert window("mistral") == 4096 and window("mistral", sliding_window=None) is None
    assert window("mistral", sliding_window=16) == 16
    assert window("llama", sliding_window=16) is None
    assert window("qwen2", sliding_window=16) is None  # use_sliding_window false
    assert window("qwen2", use_sliding_window=True, sliding_window=16) is None  # max_window_layers 28 >= 2 layers
    assert window("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1) == 16
    assert window("qwen2", use_sliding_window=True, max_window_layers=0) == 4096
    # Qwen3's as Qwen2's (transformers' Qwen3Config derives them the same way)
    assert window("qwen3", sliding_window=16) is None
    assert window("qwen3", use_sliding_window=True, sliding_window=16) is None
    assert window("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1) == 16


def test_qwen3_config_defaults_are_transformers() -> None:
    """What a Qwen3 config.json leaves out is what Qwen3Config defaults it to: head_dim 128 (not
    hidden / heads), no attention bias."""
    from transformers import Qwen3Config

    from pdserve.workers.model.config import ModelConfig

    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, num_attention_heads=2,
              num_hidden_layers=2, intermediate_size=128, vocab_size=100)
    cfg = ModelConfig.from_hf_dict(hf)
    ref = Qwen3Config(**{k: v for k, v in hf.items() if k != "model_type"})
    assert (cfg.arch, cfg.head_dim, cfg.attention_bias, cfg.qk_norm) == ("qwen3", ref.head_dim, False, True)
    assert ModelConfig.from_hf_dict({**hf, "attention_bias": True}).attention_bias
