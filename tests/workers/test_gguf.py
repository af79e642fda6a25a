"""GGUF models load as llama.cpp wrote them: tests write their own small GGUF files
the way llama.cpp's convert_hf_to_gguf.py does (its tensor names, Q/K rows
interleaved for Llama and Mistral, a gpt2 BPE tokenizer in the metadata, the
chat template), one per architecture and quantization type, and hold pdserve's
loading to transformers' own GGUF loading (the oracle)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec
from safetensors.torch import load_file

from pdserve import LLM, SamplingParams
from pdserve.workers.model.gguf import convert_gguf, find_gguf
from pdserve.workers.model.resolve import converted_dir, resolve_model
from pdserve.workers.tiny.builder import TinyModelSpec

gguf = pytest.importorskip("gguf")

_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
QTYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
          "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


def gguf_name(hf: str) -> str:
    if hf in _NAMES:
        return _NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, qtype: str, arch: str) -> Path:
    """`hf_dir` (a tiny model) as llama.cpp's converter would write it."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if arch == "qwen3":  # convert_hf_to_gguf.py writes a config's head_dim so
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    # The tokenizer: a byte-level BPE, as llama.cpp writes a gpt2-style one.
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv_heads)
        q = QTYPES[qtype] if a.ndim == 2 else gguf.GGMLQuantizationType.F32  # norms and biases stay F32
        data = gguf.quants.quantize(a, q)
        w.add_tensor(gguf_name(name), data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def models(make_model: Callable[[TinyModelSpec], Path]) -> dict[str, Path]:
    # Row sizes are multiples of 32 (a quantization block): hidden 64, intermediate 128, head_dim 16.
    models = {arch: make_model(tiny_spec(arch=arch, hidden_size=64, intermediate_size=128, init_std=0.05))
              for arch in ("llama", "qwen2", "mistral")}
    # Qwen3: head_dim 128, as its checkpoints have it (transformers' GGUF loading, the oracle, does not
    # read the file's key_length: it takes Qwen3Config's default, 128).
    models["qwen3"] = make_model(tiny_spec(arch="qwen3", hidden_size=256, num_heads=2, num_kv_heads=1,
                                           intermediate_size=128, init_std=0.05))
    return models


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


def _transformers(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 min_new_tokens=12)
            outs.append(out[0, len(p):].tolist())
    return outs, logits


# Every type on Llama (its q/k rows are permuted in a GGUF); each type on a second architecture too,
# and every other architecture's names once or twice (9 cases: the dequantizing is the same for all).
@pytest.mark.parametrize("arch, qtype", [("llama", q) for q in ("F32", "F16", "Q8_0", "Q4_1")]
                         + [("qwen2", "F16"), ("qwen2", "Q4_1"), ("mistral", "F32"), ("mistral", "Q8_0"),
                            ("qwen3", "Q8_0")])
def test_a_gguf_file_generates_what_transformers_gguf_loading_does(models: dict[str, Path], tmp_path: Path,
                                                                   arch: str, qtype: str) -> None:
    # llama.cpp writes Mistral models as its "llama" architecture (gguf-py has no other name for them).
    gguf_arch = "llama" if arch == "mistral" else arch
    path = write_gguf(models[arch], tmp_path / f"tiny-{arch}.{qtype}.gguf", qtype, gguf_arch)
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, progress=False)
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    want, logits = _transformers(path, prompts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    ours = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    top = torch.log_softmax(logits.double(), -1).topk(5)
    assert list(ours.logprobs[0]) == top.indices.tolist()
    assert np.allclose([ours.logprobs[0][i] for i in top.indices.tolist()], top.values.tolist(), atol=1e-4)


def test_the_tokenizer_and_chat_template_come_through(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = models["llama"]
    path = write_gguf(src, tmp_path / "tiny.gguf", "F16", "llama")
    out = resolve_model(str(path))
    assert out == converted_dir(path) and resolve_model(str(tmp_path)) == out  # the directory holding it, too
    original, converted = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(str(out))
    text = "def f(x):\n    return x ** 2  # héllo, wörld <|im_start|>"
    assert converted.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    ids = original.encode(text, add_special_tokens=False)
    assert converted.decode(ids) == original.decode(ids)
    chat = [{"role": "user", "content": "Hi!"}]
    assert converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # Where the serving stacks look for it (not only in transformers 5's chat_template.jinja).
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == \
        json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == json.loads((src / "config.json").read_text())["vocab_size"]


def test_a_gguf_draft_model_drafts_for_its_target(models: dict[str, Path], tmp_path: Path) -> None:
    # The draft is the target itself: its drafts are accepted, the output is the plain greedy one.
    path = write_gguf(models["llama"], tmp_path / "tiny.gguf", "Q8_0", "llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(str(path), max_model_len=256, num_kv_blocks=64, progress=False)
    ids = plain.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    spec = LLM(str(path), max_model_len=256, num_kv_blocks=64, progress=False, speculative="draft",
               draft_model=str(path), num_speculative_tokens=2, spec_max_batch_size=64)
    want = plain.generate([ids], params)[0].outputs[0].token_ids
    assert spec.generate([ids], params)[0].outputs[0].token_ids == want
    assert spec.engine.stats.spec_accepted_tokens > 0


def test_bad_gguf_input_is_a_clear_error(models: dict[str, Path], tmp_path: Path) -> None:
    good = write_gguf(models["llama"], tmp_path / "good.gguf", "F16", "llama")
    broken = tmp_path / "broken" / "cut.gguf"
    broken.parent.mkdir()
    broken.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.gguf"):
        convert_gguf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(str(garbage))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(good.read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        find_gguf(two)
    other = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(other), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2'.*not supported"):
        LLM(str(other), progress=False)


def test_a_conversion_lock_held_too_long_is_a_clear_error(tmp_path: Path) -> None:
    import fcntl

    from pdserve.workers.model import resolve

    lock = tmp_path / "gguf-x.lock"
    with open(lock, "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process converting (flock locks are per open file)
        with pytest.raises(ValueError, match="another process has been converting"):
            with resolve._locked(lock, timeout_s=0.5):
                pass
    with resolve._locked(lock, timeout_s=0.5):  # free again
        pass
