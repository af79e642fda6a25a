"""What a GGUF conversion (workers/model/gguf.py, resolve.py) must carry over beyond the weights:
the tokenizer's pre-tokenizer (the oracle: the tokenizer the GGUF was written from), llama.cpp's
stop tokens, a split file refused by name, and a cache that a killed conversion does not litter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest
from gguf_writer import hf_original, train, write
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.gguf import convert_gguf
from pdserve.workers.model.resolve import resolve_model

TEXT = "def f(x):\n    return x ** 2  # 12345 apples, 3.14159\nif n >  10:\n        y =   2024\n"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small() -> Tokenizer:
    return train("gpt2", vocab_size=600)


@pytest.mark.parametrize(("style", "pre"), [("smollm", "smollm"), ("llama3", "llama-bpe"), ("gpt2", "default")])
def test_the_converted_tokenizer_splits_text_as_the_original(tmp_path: Path, style: str, pre: str) -> None:
    """SmolLM2, the default model, is pre "smollm": digits one by one, then GPT-2's split, which
    transformers' GGUF reader does not know; it fell back to GPT-2's alone, and whitespace before
    a digit ("y =   2024") came out as other tokens than the model was trained on."""
    tok = train(style)
    out = convert_gguf(write(tok, tmp_path / "m.gguf", pre), tmp_path / "out")
    want = hf_original(tok).encode(TEXT, add_special_tokens=False)
    assert AutoTokenizer.from_pretrained(str(out)).encode(TEXT, add_special_tokens=False) == want


def test_llama_cpps_end_of_turn_token_stops_generation(tmp_path: Path, small: Tokenizer) -> None:
    """llama.cpp stops at eos, eot and eom; a GGUF whose chat turn ends at its eot token was
    decoded past it to max_tokens."""
    vocab = small.get_vocab()
    path = write(small, tmp_path / "m.gguf", "default", eos="<|endoftext|>",
                 extra={"tokenizer.ggml.eot_token_id": vocab["<|im_end|>"]})
    stops = ModelConfig.from_pretrained(resolve_model(str(path))).eos_token_ids
    assert vocab["<|im_end|>"] in stops and vocab["<|endoftext|>"] in stops


def test_one_shard_of_a_split_gguf_is_refused_by_name(tmp_path: Path, small: Tokenizer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first shard alone was converted and cached as a model, which then lacked weights."""
    init = gguf.GGUFWriter.__init__
    monkeypatch.setattr(gguf.GGUFWriter, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "split_max_tensors": 4}))
    write(small, tmp_path / "m.gguf", "default")
    with pytest.raises(ValueError, match="split GGUF"):
        resolve_model(str(tmp_path / "m-00001-of-00003.gguf"))


def test_a_killed_conversion_leaves_nothing_in_the_cache(tmp_path: Path, small: Tokenizer) -> None:
    """A conversion killed hard (OOM, SIGKILL) left its temporary directory, float32 weights of
    GBs for a real model, for good; the next conversion under the lock removes it."""
    path = write(small, tmp_path / "m.gguf", "default")
    code = textwrap.dedent(f"""
        import os, pdserve.workers.model.gguf as g
        g._write_tokenizer = lambda *a: os._exit(9)  # the weights written, then killed
        from pdserve.workers.model.resolve import resolve_model
        resolve_model({str(path)!r})
    """)
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ), timeout=120).returncode == 9
    out = resolve_model(str(path))
    assert (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    plain = out.parent / "plain"
    plain.mkdir()
    assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777  # not mkdtemp's 0700
