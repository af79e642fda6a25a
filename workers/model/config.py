"""Model architecture read straight from an HF `config.json`.

We parse the JSON ourselves instead of going through transformers' config
classes: transformers 5 renamed the RoPE keys (`rope_scaling`/`rope_theta` became
`rope_parameters`), and real checkpoints on disk carry either spelling. One
frozen dataclass is what the rest of the engine sees.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `rope_type` is "default" or "llama3"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type: unsupported RoPE scaling {self.rope_type!r} "
                             "(supported: default, linear, llama3)")
        if self.theta <= 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.theta}")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder shape every part of the engine reads (model, KV cache, runner)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # The checkpoint's weight format when it is quantized: "fp8" (e4m3 weights with scales:
    # workers/model/fp8.py), else None; `fp8_block`: [rows, columns] of a block-scaled one.
    quantization: str | None = None
    fp8_block: tuple[int, int] | None = None
    # Qwen3: an RMSNorm over each head's q and k (weights of head_dim, one for q, one for k)
    # before RoPE. Qwen3's and Llama's attention_bias: a bias on o_proj as on q/k/v.
    qk_norm: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False  # Llama's: biases on gate, up and down

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads: {self.num_kv_heads} does not divide "
                             f"num_attention_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: no config.json in {model_dir}")
        hf = _json_object(path)
        gen_path = Path(model_dir) / "generation_config.json"
        gen = _json_object(gen_path) if gen_path.is_file() else {}
        # A field missing, or a word for a number, was a KeyError traceback (or int()'s words,
        # naming no file) out of `pdserve serve` and of every worker: one line naming the file.
        try:
            return cls.from_hf_dict(hf, gen)
        except KeyError as e:
            raise ValueError(f"model: {path} has no {e.args[0]!r}, which the model needs") from None
        except (TypeError, ValueError) as e:
            if str(e).startswith("model: "):  # from_hf_dict's own refusals
                raise
            raise ValueError(f"model: {path}: a field of the wrong type ({e})") from None

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                hf.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        # Qwen3Config defaults head_dim to 128 (its checkpoints' value), not hidden / heads.
        head_dim = hf.get("head_dim") or (128 if arch == "qwen3" else hidden // num_heads)
        # Qwen2 always has q/k/v biases; Mistral none (transformers' ignores the key); Qwen3's and
        # Llama's attention_bias (off by default) biases q/k/v and o_proj.
        qkvo_bias = arch in ("qwen3", "llama") and bool(hf.get("attention_bias", False))
        attention_bias = arch == "qwen2" or qkvo_bias
        # Llama's mlp_bias biases gate, up and down (transformers' LlamaMLP); the other families'
        # MLPs have no biases at all, so a checkpoint that says so there is refused, not misread.
        mlp_bias = bool(hf.get("mlp_bias", False))
        if mlp_bias and arch != "llama":
            raise ValueError(f"model: mlp_bias=True is not supported for {arch}")
        act = hf.get("hidden_act", "silu")
        if act not in (None, "silu", "swish"):  # the MLP is SiLU-gated: another would load and run wrong
            raise ValueError(f"model: hidden_act {act!r} is not supported (only silu)")
        sliding = _sliding_window(arch, hf)
        eos = _eos_ids(gen or {}, hf)
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope=_rope_config(hf),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=(gen or {}).get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            **_quantization(hf.get("quantization_config")),
            qk_norm=arch == "qwen3",
            o_proj_bias=qkvo_bias,
            mlp_bias=mlp_bias,
        )


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError naming the file (json's own error named none)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"model: {path} is not a JSON object (it holds a {type(value).__name__})")
    return value


def _quantization(q: dict[str, Any] | None) -> dict[str, Any]:
    """`quantization` and `fp8_block` from a checkpoint's `quantization_config`: fp8 weights as
    vLLM writes them (`quant_method` "fp8", per-tensor scales or `weight_block_size`) or as
    llm-compressor does ("compressed-tensors", 8-bit float weights per tensor, channel or
    block). Anything else is refused by name rather than loaded wrong."""
    if not q:
        return {}
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config: fp8 format {q.get('fmt')!r} is not supported (e4m3 is)")
        block = q.get("weight_block_size")
        return {"quantization": "fp8", "fp8_block": (int(block[0]), int(block[1])) if block else None}
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ValueError("quantization_config: compressed-tensors other than 8-bit float weights is not supported")
        blocks = {tuple(w["block_structure"]) for w in weights if w.get("strategy") == "block"}
        if len(blocks) > 1:
            raise ValueError(f"quantization_config: several block structures {sorted(blocks)}")
        block = next(iter(blocks), None)
        return {"quantization": "fp8", "fp8_block": (int(block[0]), int(block[1])) if block else None}
    raise ValueError(f"quantization_config: quant_method {method!r} is not supported (fp8 and fp8 "
                     "compressed-tensors are)")


def _eos_ids(gen: dict[str, Any], hf: dict[str, Any]) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", hf.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _sliding_window(arch: str, hf: dict[str, Any]) -> int | None:
    """The attention window as transformers applies it (None: every layer attends to all):
    Llama has none whatever the config says; Mistral's defaults to 4096 when the key is
    absent (an explicit null: none); Qwen2's and Qwen3's only with `use_sliding_window`, 4096
    by default, and only where some layer slides (those from `max_window_layers` on)."""
    if arch == "llama":
        return None
    if arch in ("qwen2", "qwen3"):
        layers = int(hf["num_hidden_layers"])
        if not hf.get("use_sliding_window", False) or int(hf.get("max_window_layers", 28)) >= layers:
            return None
    window = hf.get("sliding_window", 4096)
    return int(window) if window else None


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints write
    # `rope_theta` plus an optional `rope_scaling` dict. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    if "factor" not in params:
        raise ValueError(f"rope_scaling: a {rope_type} rope_scaling needs a factor")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # transformers (5) defaults it to the model's max_position_embeddings
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        hf.get("max_position_embeddings", 8192))),
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (float32)."""
    import torch

    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept,
    # a smooth blend in between (same formula as transformers' _compute_llama3_parameters).
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
