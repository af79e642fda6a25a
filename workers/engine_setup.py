"""What an engine is built from: the device, dtype, context length and KV pool
size a config resolves to on this machine, and its speculator."""

from __future__ import annotations

import logging
import sys

import torch

from pdserve.kernels import cpu_decode
from pdserve.kernels.attention import AttentionBackend
from pdserve.workers.config import DType, EngineConfig, SpeculativeMethod
from pdserve.workers.kv.cache import bytes_per_block, kv_budget_bytes
from pdserve.workers.model.compiled import compile_forward
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.loader import resolve_dtype
from pdserve.workers.model.resolve import resolve_model
from pdserve.workers.model_runner import ModelRunner
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


def plan_kv(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
            max_model_len: int) -> tuple[int, int]:
    """(KV pool blocks, max_model_len). The pool: `num_kv_blocks` if set, else what
    the memory budget holds (on CPU by default no more than `max_num_seqs` whole
    sequences: blocks past that would only hold prefix cache, and every byte is
    allocated up front). It must hold one `max_model_len` sequence, which is what
    makes preemption always progress: when it cannot and the user asked for that
    length, ValueError; when the length is the model's own, the largest that fits
    is served instead, and said (vLLM refuses to start; a first run on a laptop
    should not)."""
    bs = config.block_size
    per_block = bytes_per_block(cfg, bs, dtype)
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    else:
        reserve = config.max_num_batched_tokens * cfg.intermediate_size * 16
        n = kv_budget_bytes(device, config.kv_cache_memory, config.gpu_memory_utilization, reserve) // per_block
        if device.type != "cuda" and config.kv_cache_memory is None:
            n = min(n, config.max_num_seqs * -(-max_model_len // bs))
    n = max(n, 0)
    if n >= -(-max_model_len // bs):
        return n, max_model_len
    fits = n * bs
    if config.max_model_len is not None or fits == 0:
        raise ValueError(f"num_kv_blocks: {n} blocks of {bs} tokens cannot hold one max_model_len "
                         f"({max_model_len}) sequence; raise the KV budget (kv_cache_memory, "
                         "gpu_memory_utilization, num_kv_blocks) or lower max_model_len")
    _log.warning("max_model_len: the model allows %d positions, but its KV budget (%d blocks of %d tokens) holds "
                 "%d; serving with max_model_len %d (set max_model_len, or raise kv_cache_memory / "
                 "gpu_memory_utilization)", max_model_len, n, bs, fits, fits)
    log(config, f"max_model_len lowered to {fits} tokens: what the KV budget holds (the model allows {max_model_len})")
    return n, fits


def compile_runner(config: EngineConfig, runner: ModelRunner, backend: AttentionBackend) -> None:
    """Unless `enforce_eager`: run `runner`'s model through its compiled graph,
    compiled and warmed up now (CPU; eager where that is not possible)."""
    if config.enforce_eager:
        return
    forward = compile_forward(runner.model, backend, runner.kv_caches, config.block_size,
                              config.max_num_batched_tokens, runner.device, lambda msg: log(config, msg))
    if forward is not None:
        runner.forward = forward


def prepare_attention(config: EngineConfig, backend: AttentionBackend, device: torch.device) -> None:
    """Build the CPU decode attention op now, at engine start, not in the first request's step (a
    first build takes ~20 s; later starts load it from torch's extension cache)."""
    if device.type == "cpu" and backend is AttentionBackend.TORCH and cpu_decode.enabled():
        log(config, "preparing the CPU decode attention op")
        cpu_decode.load()


def make_speculator(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                    backend: AttentionBackend, kv_blocks: int, max_model_len: int) -> Speculator | None:
    """The speculator `config.speculative` asks for (None: no speculative decoding)."""
    proposer: Proposer
    if config.speculative is SpeculativeMethod.NGRAM:
        proposer = NgramProposer(config.spec_ngram_min, config.spec_ngram_max, config.num_speculative_tokens)
    elif config.speculative is SpeculativeMethod.DRAFT:
        log(config, f"loading draft model {config.draft_model}")
        draft_dir = str(resolve_model(str(config.draft_model), progress=config.progress))  # a GGUF too
        proposer = DraftModelProposer(
            draft_dir, target, dtype, device, backend, kv_blocks, config.block_size, max_model_len,
            config.max_num_batched_tokens, config.max_num_seqs, progress=config.progress)
        compile_runner(config, proposer.runner, backend)
    else:
        return None
    return Speculator(config, proposer, max_model_len)


_log = logging.getLogger(__name__)


def log(config: EngineConfig, msg: str) -> None:
    """Progress of long work (model load, compiling), when the config asks for it."""
    _log.info("%s", msg)
    if config.progress:
        print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
