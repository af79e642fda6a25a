"""GGUF loading at its edges: files as Ollama stores them, metadata that disagrees with the
tensors, the conversion cache when a file changes under it, and the quantization types
beyond those tests/workers/test_gguf.py runs end to end. The oracle is transformers' own
GGUF loading (its dequantization is its own, apart from the `gguf` package's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from factories import tiny_spec
from gguf_writer import train, write
from safetensors.torch import load_file, save_file
from test_gguf import QTYPES, write_gguf
from tokenizers import Tokenizer

from pdserve import LLM, SamplingParams
from pdserve.workers.model.gguf import convert_gguf
from pdserve.workers.model.resolve import resolve_model
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small() -> Tokenizer:
    return train("gpt2", vocab_size=600)


@pytest.fixture(scope="module")
def llama(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(arch="llama", hidden_size=64, intermediate_size=128, init_std=0.05))


def _transformers_greedy(path: Path, prompt: list[int], n: int = 8) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_an_ollama_blob_without_the_gguf_suffix_loads(llama: Path, tmp_path: Path) -> None:
    """Ollama keeps its models as blobs named by their hash (~/.ollama/models/blobs/sha256-...),
    with no .gguf suffix; vLLM takes such a file by its GGUF magic, transformers by its name.
    pdserve refused it as "a file but not a .gguf one"."""
    blob = tmp_path / "blobs" / "sha256-6a0746a1ec1aef3e7ec53868f220ff6e389f6f8ef87a01d77c96807de94ca2aa"
    blob.parent.mkdir()
    write_gguf(llama, blob, "Q8_0", "llama")
    llm = LLM(str(blob), max_model_len=128, num_kv_blocks=32, progress=False)
    prompt = llm.tokenizer.encode("def fibonacci(n):", add_special_tokens=False)
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))[0].outputs[0]
    assert got.token_ids == _transformers_greedy(blob, prompt)
    # A file that is not GGUF, suffix or not, is still refused by name.
    other = tmp_path / "blobs" / "sha256-00"
    other.write_bytes(b"{\"not\": \"a model\"}")
    with pytest.raises(ValueError, match="sha256-00"):
        resolve_model(str(other))


def test_head_count_that_does_not_fit_the_q_rows_is_a_clear_error(small: Tokenizer, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata saying 3 heads for a Q of 64 rows crashed the conversion with torch's
    "shape '[3, 10, 2, 64]' is invalid for input of size 4096", naming neither file nor key."""
    add = gguf.GGUFWriter.add_head_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda self, n: add(self, 3))
    path = write(small, tmp_path / "bad-heads.gguf", "default")
    with pytest.raises(ValueError, match=r"bad-heads\.gguf.*head_count"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_replaced_with_its_time_kept_is_converted_again(llama: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key was path, size and mtime: a file replaced by another of the same size with
    its modification time kept (cp -p, rsync -a, tar x, a re-upload of the same quantization)
    reused the stale conversion, the old weights served as the new file's."""
    path = tmp_path / "m.gguf"
    write_gguf(llama, path, "F16", "llama")
    first = resolve_model(str(path))
    st = path.stat()
    other_dir = tmp_path / "other"  # the same model with other weights: a file of the same size
    shutil.copytree(llama, other_dir)
    weights = load_file(str(other_dir / "model.safetensors"))
    save_file({k: (v * 0.5).contiguous() for k, v in weights.items()}, str(other_dir / "model.safetensors"))
    staged = tmp_path / "staged.gguf"
    write_gguf(other_dir, staged, "F16", "llama")
    assert staged.stat().st_size == st.st_size and staged.read_bytes() != path.read_bytes()
    os.replace(staged, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # what cp -p / rsync -a / tar x do
    second = resolve_model(str(path))
    assert second != first
    got = load_file(str(second / "model.safetensors"))["model.norm.weight"]
    assert torch.allclose(got, weights["model.norm.weight"].float() * 0.5, atol=1e-3)
    # The stale conversion (float32 weights: GBs for a real model) is not kept beside the new one.
    assert not first.exists()


def test_two_processes_converting_at_once_leave_one_whole_conversion(small: Tokenizer, tmp_path: Path) -> None:
    """Every worker of a cluster starts at once: both convert-or-wait, neither reads a half one."""
    path = write(small, tmp_path / "m.gguf", "default")
    code = textwrap.dedent(f"""
        from safetensors.torch import load_file
        from pdserve.workers.model.resolve import resolve_model
        out = resolve_model({str(path)!r})
        print(out, len(load_file(str(out / "model.safetensors"))))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ), stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and outs[0][1] == "11"
    cache = Path(outs[0][0]).parent
    assert sorted(p.name for p in cache.iterdir()) == sorted([Path(outs[0][0]).name, Path(outs[0][0]).name + ".lock"])


@pytest.mark.parametrize("qtype", ["BF16", "Q4_0", "Q5_0", "Q5_1"])
def test_more_quantization_types_dequantize_as_transformers_does(llama: Path, tmp_path: Path, qtype: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(QTYPES, qtype, gguf.GGMLQuantizationType[qtype])
    path = write_gguf(llama, tmp_path / f"m.{qtype}.gguf", qtype, "llama")
    ours = load_file(str(resolve_model(str(path)) / "model.safetensors"))
    if qtype in ("Q5_0", "Q5_1"):  # transformers cannot dequantize these: the gguf package is the oracle
        reader = gguf.GGUFReader(str(path))
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(ours["model.layers.0.mlp.down_proj.weight"], want.reshape(64, 128))
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    theirs = model.state_dict()
    for name, w in ours.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            torch.testing.assert_close(w, theirs[name], rtol=0, atol=1e-6, msg=name)
    np.testing.assert_allclose(ours["model.embed_tokens.weight"].numpy(),
                               theirs["model.embed_tokens.weight"].numpy(), atol=1e-6)


@pytest.mark.parametrize("qtype", ["F64", "Q8_1", "I32"])
def test_a_tensor_type_it_cannot_read_is_refused_by_name(small: Tokenizer, tmp_path: Path, qtype: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t = gguf.GGMLQuantizationType[qtype]
    add = gguf.GGUFWriter.add_tensor

    def add_tensor(self: gguf.GGUFWriter, name: str, tensor: np.ndarray, **kw: object) -> None:
        if name != "blk.0.ffn_up.weight":
            return add(self, name, tensor, **kw)
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = np.zeros((tensor.shape[0], tensor.shape[1] // block * size), dtype=np.uint8)
        return add(self, name, raw, raw_dtype=t)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path = write(small, tmp_path / "m.gguf", "default")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"type {qtype}.*blk.0.ffn_up.weight"):
        convert_gguf(path, tmp_path / "out")


def test_a_tied_qwen2_gguf_generates_what_transformers_does(make_model: Callable[[TinyModelSpec], Path],
                                                           tmp_path: Path) -> None:
    """Qwen2's small models tie their head (no output.weight in the file), carry Q/K/V biases that
    llama.cpp does not permute, and a rope theta of 1e6 and an eps of 1e-6."""
    src = make_model(tiny_spec(arch="qwen2", hidden_size=64, intermediate_size=128, init_std=0.05,
                               tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6))
    path = write_gguf(src, tmp_path / "qwen.gguf", "Q8_0", "qwen2")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, progress=False)
    assert json.loads((resolve_model(str(path)) / "config.json").read_text())["tie_word_embeddings"] is True
    for text in ("def fibonacci(n):", "The quick brown fox"):
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))[0].outputs[0]
        assert got.token_ids == _transformers_greedy(path, prompt)


def test_a_directory_of_split_gguf_shards_says_split_not_name_one(small: Tokenizer, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory holding the shards of one split GGUF (m-00001-of-00003.gguf ...) was answered
    "holds 3 GGUF files ...; name one of them", and each one named is then refused as a shard."""
    init = gguf.GGUFWriter.__init__
    monkeypatch.setattr(gguf.GGUFWriter, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "split_max_tensors": 4}))
    (tmp_path / "split").mkdir()
    write(small, tmp_path / "split" / "m.gguf", "default")
    assert len(list((tmp_path / "split").glob("*.gguf"))) == 3
    with pytest.raises(ValueError, match="split GGUF.*merge"):
        resolve_model(str(tmp_path / "split"))


def test_more_tokens_than_embedding_rows_is_refused_when_converted(small: Tokenizer, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose token list (600) outruns its embedding (500 rows) loaded, and then each request
    whose text the tokenizer turned into an id past 500 failed; transformers refuses it at load."""
    add = gguf.GGUFWriter.add_tensor

    def add_tensor(self: gguf.GGUFWriter, name: str, tensor: np.ndarray, **kw: object) -> None:
        return add(self, name, tensor[:500] if name == "token_embd.weight" else tensor, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    path = write(small, tmp_path / "short-embd.gguf", "default")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"short-embd\.gguf.*600 tokens.*500"):
        convert_gguf(path, tmp_path / "out")
