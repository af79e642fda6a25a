"""Make tiny, randomly initialised HF-format checkpoints for tests and benchmarks.

The engine has to load real HF directories (config.json + safetensors +
tokenizer files), and the tests need an oracle to compare against. Rather than
downloading a checkpoint, we build one locally with transformers' own config
and model classes, so whatever transformers loads from the directory *is* the
reference implementation. Everything is seeded: the same `TinyModelSpec`
gives byte-identical files on the same software install.

transformers 5 note: RoPE settings live in `config.rope_parameters`
(`rope_type`, `rope_theta`, plus the llama3 keys); config.json has no
top-level `rope_theta` or `rope_scaling`. We pass `rope_parameters` and let
transformers write it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tokenizers import Tokenizer
from transformers.utils import logging as hf_logging

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

from . import tokenizer as tiny_tokenizer
from .corpus import cache_dir

__all__ = [
    "Arch",
    "build_dir",
    "DEFAULT_SPEC",
    "FORMAT_VERSION",
    "TinyModelSpec",
    "build_config",
    "cache_dir",
    "default_model_dir",
    "init_model",
    "make_tiny_model",
    "save_model_dir",
]

# Bump when the files written for a given spec change (layout, init, specials):
# it is part of the default model directory's name, so old caches are ignored.
FORMAT_VERSION = 1

# llama3 RoPE scaling as Llama 3.1 ships it, except the original context: 256
# instead of 8192 so that, at tiny head dims and contexts, the wavelength cut-
# offs (256 / low_freq_factor, 256 / high_freq_factor) fall inside the range
# of frequencies and the scaling visibly changes inv_freq.
LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


class Arch(str, Enum):
    """Supported decoder architectures (HF `model_type` values)."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    MISTRAL = "mistral"
    QWEN3 = "qwen3"


_CONFIG_CLASSES: dict[Arch, str] = {  # transformers' class names (imported when a model is built)
    Arch.LLAMA: "LlamaConfig",
    Arch.QWEN2: "Qwen2Config",
    Arch.MISTRAL: "MistralConfig",
    Arch.QWEN3: "Qwen3Config",
}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny model. Fields left as None are derived per arch.

    - `intermediate_size=None` → ceil(8/3 · hidden) rounded up to a multiple of
      64 (the Llama SwiGLU rule: same FFN FLOPs as a 4·hidden GELU MLP).
    - `tie_embeddings=None` → True for qwen2 and qwen3 (as their small models
      ship), False otherwise.
    - `rms_norm_eps=None` → 1e-6 for qwen2 and qwen3, 1e-5 otherwise.
    - `rope_theta` defaults to 10000 for every arch: at a 2048 context the
      larger Llama 3 base would leave most dimensions nearly unrotated.
    - `rope_scaling="llama3"` applies `LLAMA3_ROPE` on top of `rope_theta`.
    """

    arch: Arch = Arch.LLAMA
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int | None = None
    vocab_size: int = 4096
    seed: int = 0
    tie_embeddings: bool | None = None
    rope_theta: float = 10000.0
    rope_scaling: str | None = None
    max_position_embeddings: int = 2048
    init_std: float = 0.02
    rms_norm_eps: float | None = None

    def __post_init__(self) -> None:
        try:
            # Accept plain strings ("qwen2"); store the enum so equality and
            # hashing do not depend on how the caller spelled it.
            object.__setattr__(self, "arch", Arch(self.arch))
        except ValueError:
            raise ValueError(f"arch: must be one of {[a.value for a in Arch]}, got {self.arch!r}") from None
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "max_position_embeddings"):
            _require(name, getattr(self, name) > 0, "must be > 0")
        if self.intermediate_size is not None:
            _require("intermediate_size", self.intermediate_size > 0, "must be > 0")
        _require("vocab_size", self.vocab_size >= 512, "must be >= 512")
        _require("hidden_size", self.hidden_size % self.num_heads == 0,
                 f"must be divisible by num_heads={self.num_heads}")
        _require("num_kv_heads", self.num_heads % self.num_kv_heads == 0, f"must divide num_heads={self.num_heads}")
        _require("hidden_size", self.head_dim % 2 == 0,
                 f"head_dim {self.head_dim} (hidden_size/num_heads) must be even for RoPE")
        _require("seed", 0 <= self.seed < 2**63, "must be in [0, 2**63)")
        _require("rope_theta", self.rope_theta > 0, "must be > 0")
        _require("rope_scaling", self.rope_scaling in (None, "llama3"), "must be None or 'llama3'")
        _require("init_std", self.init_std > 0, "must be > 0")
        if self.rms_norm_eps is not None:
            _require("rms_norm_eps", self.rms_norm_eps > 0, "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """`intermediate_size`, or the derived default (see class docstring)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    @property
    def tied(self) -> bool:
        """Whether lm_head shares the embedding matrix."""
        return self.arch in (Arch.QWEN2, Arch.QWEN3) if self.tie_embeddings is None else self.tie_embeddings

    @property
    def norm_eps(self) -> float:
        if self.rms_norm_eps is not None:
            return self.rms_norm_eps
        return 1e-6 if self.arch in (Arch.QWEN2, Arch.QWEN3) else 1e-5

    def rope_parameters(self) -> dict[str, Any]:
        """The transformers-5 `rope_parameters` dict for this spec."""
        if self.rope_scaling == "llama3":
            return {"rope_type": "llama3", "rope_theta": float(self.rope_theta), **LLAMA3_ROPE}
        return {"rope_type": "default", "rope_theta": float(self.rope_theta)}

    def key(self) -> str:
        """Short stable hash of the spec and FORMAT_VERSION (for cache directory names)."""
        fields = {k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(self).items()}
        blob = json.dumps(
            {"spec": fields, "format": FORMAT_VERSION, "tokenizer_format": tiny_tokenizer.FORMAT_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _require(field: str, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {why}")


DEFAULT_SPEC = TinyModelSpec()

T = TypeVar("T")


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


@contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    # save_pretrained draws a "Writing model shards" tqdm bar; with
    # progress=False the caller asked for silence. Restore the global switch.
    was = hf_logging.is_progress_bar_enabled()
    if was and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def build_config(spec: TinyModelSpec, vocab_size: int, special_ids: dict[str, int]) -> PretrainedConfig:
    """The transformers config object for `spec` with the tokenizer's real vocab size and ids."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        # Explicit, so readers never have to re-derive it from hidden/heads.
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tied,
        rope_parameters=spec.rope_parameters(),
        bos_token_id=special_ids["bos"],
        # Both ends stop generation: end of text, and end of a chat turn.
        eos_token_id=[special_ids["eos"], special_ids["im_end"]],
        pad_token_id=special_ids["pad"],
        dtype="float32",
    )
    if spec.arch is Arch.LLAMA:
        extra: dict[str, Any] = dict(attention_bias=False, mlp_bias=False)
    elif spec.arch is Arch.MISTRAL:
        extra = dict(sliding_window=None)
    elif spec.arch is Arch.QWEN3:
        extra = dict(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        # Qwen2 always has q/k/v biases (no config switch). No sliding window:
        # use_sliding_window=False makes transformers drop it anyway; say so.
        extra = dict(use_sliding_window=False, sliding_window=None)
    # Imported here, as the model classes are below: transformers' configs and models cost 1.5-4 s
    # to import (its modeling code imports torch._dynamo), which a process that only finds the
    # model already built (every worker, every test, the gateway) should not pay.
    import transformers

    config_class: type[PretrainedConfig] = getattr(transformers, _CONFIG_CLASSES[spec.arch])
    return config_class(**common, **extra)


def _init_model(spec: TinyModelSpec, config: PretrainedConfig) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM  # here: see build_config

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF init zeroes biases; Qwen2's q/k/v biases must be non-zero or a
    # reimplementation that forgot them would still match the oracle. A
    # private generator keeps this independent of global RNG state; sorted
    # names keep the draw order fixed. Qwen3's per-head q/k norms likewise: HF inits them to
    # ones, which a model that skipped them would match.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * spec.init_std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model.eval()


def init_model(spec: TinyModelSpec, tok: Tokenizer) -> PreTrainedModel:
    """A randomly initialised model for `spec`, sized and wired for the trained tokenizer `tok`."""
    # len() counts added/special tokens too; the embedding must cover them all.
    vocab_size = len(tiny_tokenizer.wrap_tokenizer(tok))
    return _init_model(spec, build_config(spec, vocab_size, tiny_tokenizer.special_token_ids(tok)))


def save_model_dir(model: PreTrainedModel, tok: Tokenizer, out: Path, progress: bool) -> None:
    """Write `model` (weights, config, generation config) and `tok` as an HF-format directory `out`."""
    from transformers import GenerationConfig

    ids = tiny_tokenizer.special_token_ids(tok)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"]
    )
    with _hf_progress_bars(progress):
        model.save_pretrained(str(out), safe_serialization=True)
    tiny_tokenizer.save_tokenizer(tok, out, model_max_length=model.config.max_position_embeddings)


def _build_into(tmp: Path, spec: TinyModelSpec, progress: bool) -> int:
    """Write every file of the model into `tmp`; return the parameter count."""
    tok = tiny_tokenizer.train_tokenizer(spec.vocab_size, progress=progress)
    _log(progress, "initialising weights…")
    model = init_model(spec, tok)
    save_model_dir(model, tok, tmp, progress)
    return int(model.num_parameters())


def build_dir(out_dir: str | Path, build: Callable[[Path], T], replace: bool) -> tuple[Path, T, bool]:
    """Run `build(tmp)` in a private directory next to `out_dir`, then rename it to `out_dir`.

    Readers of `out_dir` never see a partial directory. An existing `out_dir`
    is replaced, or kept as is when `replace=False`; only a directory of what
    such a build writes is replaced (no other file in it: an earlier build),
    anything else is a ValueError, as is a path that cannot be written. On any
    error the private directory is removed. Returns (absolute `out_dir`, what
    `build` returned, whether this call's directory was published).
    """
    if not str(out_dir).strip():
        raise ValueError("out_dir: must not be empty")
    out = Path(out_dir).absolute()
    if replace and (out.is_symlink() or out.exists()) and not out.is_dir():  # refused before building, too
        raise ValueError(f"out_dir: {out} exists and is not a directory: choose another path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        raise ValueError(f"out_dir: cannot write {out}: {e.strerror or e}") from None
    try:
        result = build(tmp)
        # mkdtemp makes 0700 dirs; a model dir should be as readable as any
        # other directory the user creates.
        os.chmod(tmp, 0o777 & ~_umask())
        published = _publish(tmp, out, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, result, published


def _publish(tmp: Path, out: Path, replace: bool) -> bool:
    """Move the finished `tmp` dir to `out`. Returns False if `out` already existed and was kept."""
    try:
        # rename(2) onto a missing or empty dir is atomic; onto a non-empty dir
        # it fails, which is how a lost race (or an existing model) shows up.
        os.rename(tmp, out)
        return True
    except OSError:
        if not out.exists():
            raise
    if not replace:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    _check_replaceable(out, tmp)
    # Swap: move the old dir aside first so `out` is missing only for the
    # instant between the two renames, never half-written.
    trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, trash / "old")
    os.rename(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _check_replaceable(out: Path, built: Path) -> None:
    """ValueError unless `out` is a directory holding only files a build like `built` writes: a
    user's directory, file or device of that name is never deleted to make room (`pdserve
    make-tiny-model /dev/null` replaced the device with a model)."""
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"out_dir: {out} exists and is not a directory: choose another path")
    others = sorted(set(os.listdir(out)) - set(os.listdir(built)))
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ValueError(f"out_dir: {out} exists and holds files this would not write ({shown}): choose another "
                         "path, or remove it first")


def make_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = DEFAULT_SPEC, progress: bool = True, replace: bool = True
) -> Path:
    """Write a randomly initialised HF-format model directory for `spec` at `out_dir`.

    Files: config.json, generation_config.json, model.safetensors (float32),
    tokenizer.json, tokenizer_config.json (with the ChatML chat_template).
    The directory is built next to `out_dir` and renamed into place, so
    readers never see a partial model. An existing `out_dir` is replaced, or
    kept as is when `replace=False`. Returns `out_dir`.
    """
    out, n_params, published = build_dir(out_dir, lambda tmp: _build_into(tmp, spec, progress), replace)
    _log(progress, f"wrote {out} ({n_params} params)" if published else f"kept existing {out}")
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_model_dir(progress: bool = True) -> Path:
    """Path of the default tiny Llama model in the cache, made on first use.

    `cache_dir()/models/tiny-llama-<hash of DEFAULT_SPEC and format version>`.
    Safe under concurrent first use: each process builds privately and renames
    into place; a process that loses the race discards its copy and uses the
    existing one.
    """
    out = cache_dir() / "models" / f"tiny-{DEFAULT_SPEC.arch.value}-{DEFAULT_SPEC.key()}"
    # The rename is the last step, so a directory that exists is complete.
    if out.is_dir():
        return out
    return make_tiny_model(out, DEFAULT_SPEC, progress=progress, replace=False)
