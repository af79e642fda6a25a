"""Tests for the tiny HF-format model maker (`pdserve.workers.tiny`).

Every directory is checked by loading it back with transformers itself: that
is the oracle the engine is compared against, so it must accept our files.
The cache (trained tokenizer, default model) lives in a per-session temp dir,
never in the real ~/.cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from tokenizers import pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from pdserve.workers.tiny import builder, corpus, tokenizer
from pdserve.workers.tiny.builder import Arch, TinyModelSpec, make_tiny_model

ARCH_CASES = {
    "llama-gqa": tiny_spec(Arch.LLAMA),
    "llama-mha": tiny_spec(Arch.LLAMA, num_kv_heads=4),
    "qwen2": tiny_spec(Arch.QWEN2),
    "mistral": tiny_spec(Arch.MISTRAL),
}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --- loading with transformers ---------------------------------------------


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_loads_in_transformers(case: str, make_model: Callable[[TinyModelSpec], Path]) -> None:
    spec = ARCH_CASES[case]
    d = make_model(spec)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= {p.name for p in d.iterdir()}

    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    # Every tensor in the file is used and none is re-initialised.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = model.config
    assert cfg.model_type == spec.arch.value
    assert cfg.num_hidden_layers == 2
    assert cfg.hidden_size == 64
    assert cfg.num_attention_heads == 4
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert cfg.head_dim == 16
    assert cfg.intermediate_size == spec.ffn_size == 192
    assert cfg.vocab_size == spec.vocab_size
    assert cfg.tie_word_embeddings is spec.tied
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg.rms_norm_eps == (1e-6 if spec.arch is Arch.QWEN2 else 1e-5)

    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (spec.num_kv_heads * 16, 64)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is spec.tied
    if spec.arch is Arch.QWEN2:
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.bias is not None and proj.bias.abs().min() > 0
        assert attn.o_proj.bias is None
    else:
        assert attn.q_proj.bias is None and attn.o_proj.bias is None
    if spec.arch is Arch.MISTRAL:
        assert cfg.sliding_window is None

    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("def add(a, b):\n    return a + b", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], spec.vocab_size)
    assert torch.isfinite(logits).all()
    # Random init, but not degenerate: different positions give different logits.
    assert not torch.allclose(logits[0, 0], logits[0, -1])


def test_default_spec_shape() -> None:
    spec = builder.DEFAULT_SPEC
    assert (spec.arch, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (
        Arch.LLAMA, 4, 256, 8, 2, 4096,
    )
    assert spec.ffn_size == 704  # ceil(256 * 8/3 / 64) * 64
    assert not spec.tied and spec.norm_eps == 1e-5
    qwen = TinyModelSpec(arch="qwen2")
    assert qwen.arch is Arch.QWEN2 and qwen.tied and qwen.norm_eps == 1e-6
    assert TinyModelSpec(arch="qwen2", tie_embeddings=False).tied is False


# --- tokenizer -------------------------------------------------------------


TEXTS = [
    "héllo wörld ✓ 你好",
    "",
    " leading space and trailing  \n",
    "tabs\tand\r\nCRLF\x00nul and \x7f del",
    "emoji 👩‍💻 🇫🇷 and combining e\u0301",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|> literal specials <|im_end|> in text",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(text: str, make_model: Callable[[TinyModelSpec], Path]) -> None:
    tok = AutoTokenizer.from_pretrained(make_model(ARCH_CASES["llama-gqa"]))
    ids = tok.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == text


def test_tokenizer_is_byte_level_with_specials(make_model: Callable[[TinyModelSpec], Path]) -> None:
    d = make_model(ARCH_CASES["llama-gqa"])
    tok = AutoTokenizer.from_pretrained(d)
    vocab = tok.get_vocab()
    # All 256 byte symbols are tokens, so no input can be unknown.
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)
    assert len(tok) == tok.vocab_size == AutoConfig.from_pretrained(d).vocab_size == 4096
    # No BOS is prepended: encode is exactly the text.
    assert tok.encode("hi")[0] != tok.bos_token_id
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    for special in tokenizer.SPECIAL_TOKENS:
        assert tok.encode(special) == [vocab[special]]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_renders_chatml(make_model: Callable[[TinyModelSpec], Path]) -> None:
    d = make_model(ARCH_CASES["qwen2"])
    # The template is in tokenizer_config.json itself, not only chat_template.jinja.
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(d)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ✓<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_generation_config_stops_on_both_eos(make_model: Callable[[TinyModelSpec], Path]) -> None:
    d = make_model(ARCH_CASES["mistral"])
    tok = AutoTokenizer.from_pretrained(d)
    gen = GenerationConfig.from_pretrained(d)
    eot, im_end = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|im_end|>"])
    assert gen.eos_token_id == [eot, im_end]
    assert gen.bos_token_id == tok.bos_token_id and gen.pad_token_id == tok.pad_token_id


def test_tokenizer_training_is_deterministic_and_cached(session_cache: Path) -> None:
    # Warm (or reuse) the cache, then train from scratch twice.
    cached = tokenizer.train_tokenizer(4096).to_str()
    fresh = [tokenizer.train_tokenizer(4096, use_cache=False).to_str() for _ in range(2)]
    assert fresh[0] == fresh[1] == cached
    assert len(list((session_cache / "tokenizers").glob("bpe-v*-vocab4096-*.json"))) == 1


def test_tokenizer_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="^vocab_size"):
        tokenizer.train_tokenizer(100)


# --- determinism -----------------------------------------------------------


def test_same_spec_gives_identical_files(tmp_path: Path, make_model: Callable[[TinyModelSpec], Path]) -> None:
    spec = ARCH_CASES["qwen2"]
    again = make_tiny_model(tmp_path / "again", spec, progress=False)
    assert _files(again) == _files(make_model(spec))


def test_different_seed_changes_weights_only(tmp_path: Path, make_model: Callable[[TinyModelSpec], Path]) -> None:
    a = _files(make_model(ARCH_CASES["llama-gqa"]))
    b = _files(make_tiny_model(tmp_path / "seed1", tiny_spec(Arch.LLAMA, seed=1), progress=False))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"
    }


# --- RoPE ------------------------------------------------------------------


def test_llama3_rope_scaling_changes_inv_freq(make_model: Callable[[TinyModelSpec], Path]) -> None:
    plain_dir = make_model(ARCH_CASES["llama-gqa"])
    scaled_dir = make_model(tiny_spec(Arch.LLAMA, rope_scaling="llama3"))
    raw = json.loads((scaled_dir / "config.json").read_text())
    # transformers 5 spelling: one `rope_parameters` dict, no rope_scaling/rope_theta.
    assert raw["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    assert "rope_scaling" not in raw and "rope_theta" not in raw

    plain = AutoModelForCausalLM.from_pretrained(plain_dir).model.rotary_emb
    scaled = AutoModelForCausalLM.from_pretrained(scaled_dir).model.rotary_emb
    assert scaled.rope_type == "llama3" and plain.rope_type == "default"
    assert not torch.equal(plain.inv_freq, scaled.inv_freq)
    # Highest frequency (wavelength 2π < 256/4) untouched; lowest (wavelength
    # far above 256) divided by the factor.
    torch.testing.assert_close(scaled.inv_freq[0], plain.inv_freq[0])
    torch.testing.assert_close(scaled.inv_freq[-1], plain.inv_freq[-1] / 8)


# --- spec validation -------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"hidden_size": 66}, "hidden_size"),  # not divisible by 4 heads
        ({"hidden_size": 12}, "hidden_size"),  # head_dim 3 is odd
        ({"num_heads": 0}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"vocab_size": 511}, "vocab_size"),
        ({"seed": -1}, "seed"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"init_std": 0.0}, "init_std"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ],
)
def test_invalid_spec_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        tiny_spec(**kwargs)


# --- cache and atomic writes -----------------------------------------------


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert builder.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builder.cache_dir() == tmp_path / "xdg" / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builder.cache_dir() == tmp_path / "home" / ".cache" / "pdserve"


def test_default_model_dir_builds_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, session_cache: Path) -> None:
    # Fresh cache for the model, but reuse the session's trained tokenizer.
    shutil.copytree(session_cache / "tokenizers", tmp_path / "tokenizers")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    builds: list[Path] = []
    real_make = builder.make_tiny_model

    def counting_make(out_dir: Path, spec: TinyModelSpec, **kw: object) -> Path:
        builds.append(Path(out_dir))
        return real_make(out_dir, spec, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builder, "make_tiny_model", counting_make)
    first = builder.default_model_dir(progress=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = builder.default_model_dir(progress=False)
    assert first == second and len(builds) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path / "models" and first.name.startswith("tiny-llama-")
    assert AutoConfig.from_pretrained(first).num_hidden_layers == 4
    # Only the finished model is left next to it: no temp dirs.
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_existing_dir_kept_or_replaced(tmp_path: Path) -> None:
    out = tmp_path / "m"
    make_tiny_model(out, tiny_spec(seed=0), progress=False)
    original = _files(out)
    # replace=False is what a process that lost the default-model race does.
    make_tiny_model(out, tiny_spec(seed=1), progress=False, replace=False)
    assert _files(out) == original
    make_tiny_model(out, tiny_spec(seed=1), progress=False)
    assert _files(out)["model.safetensors"] != original["model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_a_path_that_is_not_an_earlier_build_is_never_replaced(tmp_path: Path) -> None:
    """`pdserve make-tiny-model` onto a user's directory deleted what was in it, and onto a
    file or a device (/dev/null, as root) replaced it: refused now, all of it kept, and nothing
    of the build left beside it. An empty path (the working directory) is refused too; so is a
    path that cannot be written."""
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "thesis.txt").write_text("my thesis")
    (tmp_path / "afile").write_text("data")
    for out, why in ((kept, "holds files this would not write (thesis.txt)"), (tmp_path / "afile", "not a directory"),
                     ("", "must not be empty"), (tmp_path / "afile" / "sub", "cannot write")):
        with pytest.raises(ValueError, match=rf"^out_dir: .*{re.escape(why)}"):
            make_tiny_model(out, tiny_spec(), progress=False)
    assert (kept / "thesis.txt").read_text() == "my thesis" and (tmp_path / "afile").read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == ["afile", "mine"] and os.listdir(kept) == ["thesis.txt"]
    r = subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", str(kept)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("pdserve: error: out_dir: "), r.stderr
    assert os.listdir(kept) == ["thesis.txt"]


def test_progress_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_tiny_model(tmp_path / "m", tiny_spec(), progress=True)
    err = capsys.readouterr().err
    assert "initialising weights…" in err
    assert f"wrote {tmp_path / 'm'} (" in err and " params)" in err


# --- corpus ----------------------------------------------------------------


def test_corpus_is_capped_sorted_and_skips_tests() -> None:
    cap = 1_000_000
    files = corpus.corpus_files(cap)
    root = corpus.stdlib_root()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels)
    assert sum(f.stat().st_size for f in files) <= cap
    assert not any(set(Path(r).parts[:-1]) & {"test", "tests", "idlelib", "site-packages"} for r in rels)
    assert corpus.corpus_fingerprint(cap) == corpus.corpus_fingerprint(cap) != corpus.corpus_fingerprint(2 * cap)
    assert len(corpus.corpus_text(cap).encode("utf-8", errors="replace")) > cap // 2
