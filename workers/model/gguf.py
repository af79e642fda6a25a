"""GGUF (llama.cpp's format) to an HF-format directory the engine loads unchanged.

Read with the `gguf` package (llama.cpp's own reader): every tensor dequantized
(`gguf.quants.dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants ...)
to `dtype`, renamed from llama.cpp's names to HF's, and for Llama/Mistral the
rows of Q and K put back in HF's rotary order (llama.cpp's converter interleaves
them). The config comes from the GGUF's metadata; the tokenizer and its chat
template from transformers' GGUF tokenizer reader (a well-kept one; the weights
are read here so that transformers' own GGUF loading stays an independent
oracle for the tests).

The directory is written next to `out_dir` and renamed into place: a crash never
leaves a half-converted model where a reader would take it for a whole one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pdserve.workers.model.loader import resolve_dtype

log = logging.getLogger(__name__)

# GGUF `general.architecture` -> (HF architecture, model_type, Q/K rows interleaved by llama.cpp).
# llama.cpp writes Mistral models as "llama" (the same layers; their sliding window, where
# they have one, is in the metadata below).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",  # Qwen3
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_SPLIT_NAME = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # llama-gguf-split's shard names
_SHARD_BYTES = 2 << 30  # safetensors files of at most ~2 GiB: no whole-model copy in memory


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> HF's; ValueError for one this engine has no use for."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"model: GGUF tensor {gguf_name!r} is not one a Llama/Qwen2/Qwen3/Mistral model has")


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (convert_hf_to_gguf.py `LlamaModel.permute`):
    per head, its rows were split in halves and interleaved pairwise."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class GGUFModel:
    """A GGUF file's metadata and tensors (read lazily: memory-mapped by the reader)."""

    def __init__(self, path: Path) -> None:
        import gguf  # here: only GGUF users need the package loaded

        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # noqa: BLE001 - the reader raises anything on a bad file
            raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from None
        shards = self.reader.fields.get("split.count")
        if shards is not None and int(shards.contents()) > 1:
            raise ValueError(f"model: {path.name} is one shard of a split GGUF ({int(shards.contents())} files); "
                             "merge them first (llama-gguf-split --merge) and give the merged file")
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"model: GGUF architecture {self.arch!r} in {path.name} is not supported "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is None:
                raise ValueError(f"model: GGUF metadata {key!r} missing in {self.path.name}")
            return default
        return f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def hf_config(self, dtype: str) -> dict[str, Any]:
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ValueError(f"model: {self.path.name} carries Llama 3.1 RoPE frequencies (rope_freqs); "
                             "this converter does not read them: use the HF checkpoint")
        hf_arch, model_type, _ = ARCHITECTURES[self.arch]
        hidden = int(self.arch_field("embedding_length"))
        heads = int(self.arch_field("attention.head_count"))
        head_dim = int(self.arch_field("attention.key_length", 0) or hidden // heads)
        # The embedding's rows, not the token list: some models pad their vocabulary past it.
        embd = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ValueError(f"model: {self.path.name} has no token_embd.weight tensor")
        vocab = int(embd.shape[-1])  # GGML lists dimensions fastest first: [hidden, vocab]
        # More tokens than rows: the model would load and then refuse every request whose text
        # tokenizes to an id past its rows (transformers refuses such a file at load).
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens.data) > vocab:
            raise ValueError(f"model: {self.path.name} has {len(tokens.data)} tokens but its token_embd.weight "
                             f"only {vocab} rows")
        cfg: dict[str, Any] = {
            "architectures": [hf_arch], "model_type": model_type,
            "vocab_size": int(vocab), "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length")),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "torch_dtype": dtype,
        }
        scaling = self.arch_field("rope.scaling.type", "none")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self.arch_field("rope.scaling.factor"))}
        elif scaling != "none":
            raise ValueError(f"model: GGUF RoPE scaling {scaling!r} is not supported (supported: none, linear)")
        if model_type in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
        if self.arch_field("attention.sliding_window", 0):
            cfg["sliding_window"] = int(self.arch_field("attention.sliding_window"))
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            f = self.reader.fields.get(name)
            if f is not None:
                cfg[key] = int(f.contents())
        return cfg

    def stop_token_ids(self) -> list[int]:
        """eos, eot and eom (those the file names, each once): where llama.cpp stops."""
        out: list[int] = []
        for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            f = self.reader.fields.get(name)
            if f is not None and int(f.contents()) not in out:
                out.append(int(f.contents()))
        return out

    def tensors(self, dtype: torch.dtype) -> Any:
        """(HF name, tensor in `dtype`) for every tensor, in file order, dequantized one at a time."""
        from gguf.quants import dequantize

        _, _, interleaved = ARCHITECTURES[self.arch]
        heads = int(self.arch_field("attention.head_count"))
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        head_dim = int(self.arch_field("attention.key_length", 0)
                       or int(self.arch_field("embedding_length")) // heads)
        # Q/K/V rows the metadata implies: checked before unpermute, whose reshape otherwise
        # fails with torch's bare "shape '[3, 10, 2, 64]' is invalid", naming no file or key.
        rows = {"q_proj": ("head_count", heads * head_dim), "k_proj": ("head_count_kv", kv_heads * head_dim),
                "v_proj": ("head_count_kv", kv_heads * head_dim)}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            proj = name.split(".")[-2]
            if proj in rows and int(t.shape[-1]) != rows[proj][1]:
                raise ValueError(f"model: GGUF tensor {t.name} of {self.path.name} has {int(t.shape[-1])} rows, but "
                                 f"its metadata ({self.arch}.attention.{rows[proj][0]}, head size {head_dim}) "
                                 f"implies {rows[proj][1]}")
            try:
                array = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"model: GGUF tensor type {t.tensor_type.name} of {t.name} is not supported: "
                                 f"{e}") from None
            # GGML lists dimensions fastest first; numpy (and HF) slowest first.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            w = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a copy: the file is read-only
            if interleaved and name.endswith("q_proj.weight"):
                w = unpermute(w, heads)
            elif interleaved and name.endswith("k_proj.weight"):
                w = unpermute(w, kv_heads)
            yield name, w.to(dtype).contiguous(), int(t.n_bytes)


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one in a directory that has no
    safetensors; None for an HF directory. ValueError when it cannot tell which."""
    if path.is_file():
        # By its magic, not only its name: Ollama keeps its GGUF files as blobs named
        # sha256-<hash>, no suffix (vLLM takes a file by its magic too).
        if path.suffix != ".gguf" and not _has_gguf_magic(path):
            raise ValueError(f"model: {path} is a file but not a GGUF one (no .gguf suffix, no GGUF magic)")
        return path
    if not path.is_dir():
        if path.exists():  # a device, a pipe, a socket (/dev/null was said not to exist)
            raise ValueError(f"model: {path} is neither a model directory nor a GGUF file")
        raise ValueError(f"model: {path} does not exist")
    ggufs = sorted(path.glob("*.gguf"))
    if not ggufs or any(path.glob("*.safetensors")):
        return None
    if len(ggufs) > 1 and all(_SPLIT_NAME.search(g.name) for g in ggufs):
        # "name one of them" would send the user to a shard, itself refused as one (GGUFModel)
        raise ValueError(f"model: {path} holds the {len(ggufs)} files of a split GGUF ({ggufs[0].name} ...); "
                         "merge them first (llama-gguf-split --merge) and give the merged file")
    if len(ggufs) > 1:
        raise ValueError(f"model: {path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}); "
                         "name one of them")
    return ggufs[0]


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = False) -> Path:
    """Write `gguf_path` as an HF-format directory at `out_dir` (replaced if it exists)."""
    torch_dtype = resolve_dtype(dtype)
    model = GGUFModel(gguf_path)
    config = model.hf_config(dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_weights(model, tmp, torch_dtype, progress)
        _write_tokenizer(gguf_path, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        stops = model.stop_token_ids()
        if len(stops) > 1:  # llama.cpp stops at each of eos, eot and eom: a chat's turn may end at eot
            gen["eos_token_id"] = stops
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "SOURCE").write_text(f"converted by pdserve from {gguf_path}\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700: a shared cache's other users could not read it
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_weights(model: GGUFModel, out: Path, dtype: torch.dtype, progress: bool) -> None:
    total = sum(int(t.n_bytes) for t in model.reader.tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {model.path.name}", disable=not progress,
               file=sys.stderr)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        files.append(name)
        shards.append({})

    weight_map: dict[str, int] = {}
    for name, w, n_bytes in model.tensors(dtype):
        nbytes = w.numel() * w.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            flush()
            size = 0
        shards[-1][name] = w
        weight_map[name] = len(files)
        size += nbytes
        bar.update(n_bytes)
    flush()
    bar.close()
    if len(files) == 1:
        os.replace(out / files[0], out / "model.safetensors")
        return
    index = {"metadata": {}, "weight_map": {n: files[i] for n, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    """transformers' GGUF tokenizer reader: vocab, merges, specials and chat template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the user needs the file named
        raise ValueError(f"model: could not read the tokenizer of {gguf_path.name}: {e}") from None
    _set_pre_tokenizer(tok, gguf_path)
    # The serving stacks (and the tiny model, workers/tiny/tokenizer.py) keep the chat
    # template in tokenizer_config.json, not in transformers 5's separate .jinja file.
    tok.save_pretrained(str(out), save_jinja_files=False)


# llama.cpp's pre-tokenizer types (`tokenizer.ggml.pre`) that split every digit on its own before
# GPT-2's regex (llama-vocab.cpp: "\\p{N}", then GPT-2's), which transformers' GGUF reader does not
# know: it fell back to GPT-2's regex alone, so SmolLM2 (the default model, pre "smollm") split
# whitespace before digits unlike its own tokenizer ("x =   2024": 'ĠĠ', 'Ġ', '2' for 'ĠĠĠ', '2').
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r"})


def _set_pre_tokenizer(tok: Any, gguf_path: Path) -> None:
    """The original tokenizer's pre-tokenizer, where transformers' reader left GPT-2's in its place."""
    import gguf
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    field = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    pre = str(field.contents()) if field is not None else "default"
    if pre in _DIGITS_THEN_GPT2:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in ("default", "gpt2"):
        log.warning("%s: pre-tokenizer %r is not one pdserve or transformers knows; GPT-2's split is used, "
                    "so some texts may tokenize unlike the original model's", gguf_path.name, pre)
