"""What an engine is built from: the device, dtype, context length and KV pool
size a config resolves to on this machine, and its speculator."""

from __future__ import annotations

import sys

import torch

from pdserve.kernels.attention import AttentionBackend
from pdserve.workers.config import DType, EngineConfig, SpeculativeMethod
from pdserve.workers.kv.cache import bytes_per_block, kv_budget_bytes
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.loader import resolve_dtype
from pdserve.workers.spec.draft import DraftModelProposer
from pdserve.workers.spec.ngram import NgramProposer
from pdserve.workers.spec.planner import Speculator
from pdserve.workers.spec.proposer import Proposer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model_dtype(dtype: DType, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is not DType.AUTO:
        return resolve_dtype(dtype.value)
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and the tiny model is small
    return resolve_dtype(cfg.torch_dtype) if cfg.torch_dtype in ("float16", "bfloat16") else torch.bfloat16


def resolve_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        # Attention here is full-context; past the window it would differ from the model's.
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len: {requested} exceeds the model's limit of {limit} positions")
    return requested


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> int:
    """The KV pool size: `num_kv_blocks` if set, else what the memory budget holds;
    ValueError if that cannot hold one `max_model_len` sequence."""
    per_block = bytes_per_block(cfg, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    else:
        reserve = config.max_num_batched_tokens * cfg.intermediate_size * 16
        n = kv_budget_bytes(device, config.kv_cache_memory, config.gpu_memory_utilization, reserve) // per_block
    need = -(-max_model_len // config.block_size)
    if n < need:
        raise ValueError(f"num_kv_blocks: {n} blocks of {config.block_size} tokens cannot hold one "
                         f"max_model_len ({max_model_len}) sequence; raise the KV budget or lower max_model_len")
    return n


def make_speculator(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                    backend: AttentionBackend, kv_blocks: int, max_model_len: int) -> Speculator | None:
    """The speculator `config.speculative` asks for (None: no speculative decoding)."""
    proposer: Proposer
    if config.speculative is SpeculativeMethod.NGRAM:
        proposer = NgramProposer(config.spec_ngram_min, config.spec_ngram_max, config.num_speculative_tokens)
    elif config.speculative is SpeculativeMethod.DRAFT:
        log(config, f"loading draft model {config.draft_model}")
        proposer = DraftModelProposer(
            str(config.draft_model), target, dtype, device, backend, kv_blocks, config.block_size, max_model_len,
            config.max_num_batched_tokens, config.max_num_seqs, progress=config.progress)
    else:
        return None
    return Speculator(config, proposer, max_model_len)


def log(config: EngineConfig, msg: str) -> None:
    """Progress of long work (model load), when the config asks for it."""
    if config.progress:
        print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
