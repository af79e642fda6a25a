"""What an engine is built from: the device, dtype, context length, KV pool size and
threads a config resolves to on this machine, and its speculator."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kernels import cpu_decode
from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers import memory_plan
from pdserve.workers.config import DType, EngineConfig, SpeculativeMethod
from pdserve.workers.cpu_features import has_native_bf16
from pdserve.workers.cpu_lending import CpuLending
from pdserve.workers.cpu_turns import node_cores
from pdserve.workers.kv.cache import CPU_DEFAULT_KV_BYTES, DeviceMemory, bytes_per_block, kv_budget_bytes
from pdserve.workers.memory_plan import CudaMemoryProbe, MemoryProbe
from pdserve.workers.model.compiled import compile_forward
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model.loader import resolve_dtype
from pdserve.workers.model.packed_linear import num_parameters
from pdserve.workers.model.resolve import resolve_model
from pdserve.workers.model.tensor_parallel import check_shardable
from pdserve.workers.model_runner import ModelRunner
from pdserve.workers.spec.draft import DraftModelProposer, load_draft_model
from pdserve.workers.spec.ngram import NgramProposer
from pdserve.workers.spec.planner import Speculator
from pdserve.workers.spec.proposer import Proposer
from pdserve.workers.tp_devices import check_rank_devices, rank_device
from pdserve.workers.tp_group import FollowerSpec, TPGroup, tp_group_running


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        # Now, not at the first CUDA call deep in loading (or never: a Ray actor that got no GPU).
        raise ValueError(f"device: {name!r} asked for, but torch sees no CUDA device here "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}; "
                         "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>") + ")")
    return device


def tokenizer_source(tokenizer: str | None, model_dir: str) -> str:
    """What AutoTokenizer loads: `tokenizer` (a directory, or a hub id) or the model's directory.
    A path that is not there is refused by name: transformers took it for a hub id and said
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    if tokenizer is None:
        return model_dir
    if looks_like_path(tokenizer) and not os.path.isdir(os.path.expanduser(tokenizer)):
        raise ValueError(f"tokenizer: {tokenizer} is not a directory on this machine")
    return os.path.expanduser(tokenizer)


def looks_like_path(name: str) -> bool:
    """A filesystem path rather than a hub id ("org/name"): absolute, ~, ./ or ../, or more than one /."""
    return name.startswith(("/", "~", "./", "../")) or name.count("/") > 1


def memory_probe(device: torch.device) -> MemoryProbe | None:
    """On CUDA, the probe the memory plan measures with: make it before the engine allocates
    anything on the device (it reads what others use then). None on CPU."""
    return CudaMemoryProbe(device) if device.type == "cuda" else None


def load_draft(config: EngineConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
               backend: AttentionBackend, max_positions: int, tokenizer: Any = None) -> LlamaForCausalLM | None:
    """The draft model (speculative="draft"), loaded before the KV pool is sized; else None.
    `tokenizer`: the target's, which the draft's must equal (spec/draft.py `check_draft_vocabulary`)."""
    if config.speculative is not SpeculativeMethod.DRAFT:
        return None
    log(config, f"loading draft model {config.draft_model}")
    draft_dir = str(resolve_model(str(config.draft_model), progress=config.progress))  # a GGUF too
    return load_draft_model(draft_dir, target, dtype, device, backend, max_positions, progress=config.progress,
                            tokenizer=tokenizer)


def measures_memory(config: EngineConfig, probe: MemoryProbe | None) -> bool:
    """Whether the KV pool is sized from measured memory (`measure_memory`): a probe (CUDA) and
    no size given."""
    return probe is not None and config.num_kv_blocks is None and config.kv_cache_memory is None


def measure_memory(config: EngineConfig, probe: MemoryProbe | None, model: LlamaForCausalLM,
                   draft: LlamaForCausalLM | None, dtype: torch.dtype, device: torch.device,
                   max_model_len: int, tp_group: TPGroup | None = None) -> DeviceMemory | None:
    """What `plan_kv` sizes a GPU's KV pool from: measured after loading (workers/memory_plan.py);
    with tensor-parallel ranks, the tightest of every rank's own measure. None when nothing needs
    measuring (CPU, or the pool's size is given)."""
    if not measures_memory(config, probe):
        return None
    assert probe is not None
    log(config, "profiling a step of max_num_batched_tokens to size the KV cache")
    memory = memory_plan.measure(config, probe, model, draft, dtype, device, max_model_len)
    return memory if tp_group is None else tp_group.tightest_memory(memory, config.gpu_memory_utilization)


def resolve_model_dtype(dtype: DType, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is not DType.AUTO:
        return resolve_dtype(dtype.value)
    if device.type == "cpu":
        # bfloat16 where the CPU computes it natively (as vLLM's CPU build does), else float32:
        # emulated half precision is slower than float32 (workers/cpu_features.py).
        return torch.bfloat16 if has_native_bf16() else torch.float32
    return resolve_dtype(cfg.torch_dtype) if cfg.torch_dtype in ("float16", "bfloat16") else torch.bfloat16


def resolve_quantization(requested: str | None, cfg: ModelConfig) -> str | None:
    """The weight format the engine loads: the checkpoint's own when it is quantized (asking
    for it again is fine), else what was asked for (None: the checkpoint's dtype)."""
    if cfg.quantization is not None and requested not in (None, cfg.quantization):
        raise ValueError(f"quantization: the checkpoint is {cfg.quantization}; it cannot load as {requested}")
    return cfg.quantization or requested


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


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The target's KV cache dtype: the model's (`auto`), or e4m3 (`fp8`, `fp8_e4m3`)."""
    return torch.float8_e4m3fn if config.kv_cache_dtype in ("fp8", "fp8_e4m3") else dtype


def plan_kv(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
            max_model_len: int, *, draft: ModelConfig | None = None,
            memory: DeviceMemory | None = None) -> tuple[int, int]:
    """(KV pool blocks, max_model_len). The pool: `num_kv_blocks` if set, else what
    the memory budget holds: `kv_cache_memory`, else (CUDA) what `memory` (measured:
    `measure_memory`) leaves of `gpu_memory_utilization` of the device, else (CPU) 4 GiB
    but no more than `max_num_seqs` whole sequences (blocks past that would only hold
    prefix cache, and every byte is allocated up front). A block costs its K and V in
    every layer of the target and, with a `draft` model, of the draft too (it keeps a
    pool of as many blocks). The pool must hold one `max_model_len` sequence, which is
    what makes preemption always progress: when it cannot and the user asked for that
    length, ValueError; when the length is the model's own, the largest that fits
    is served instead, and said (vLLM refuses to start; a first run on a laptop
    or a checkpoint's 128k context on a small card should not)."""
    bs = config.block_size
    per_block = (bytes_per_block(cfg, bs, kv_cache_dtype(config, dtype))
                 + (bytes_per_block(draft, bs, dtype) if draft is not None else 0))
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        n = config.kv_cache_memory // per_block
    elif memory is not None:
        n = max(kv_budget_bytes(memory, config.gpu_memory_utilization), 0) // per_block
        _log_plan(config, memory, per_block, n)
        if n == 0:
            raise ValueError(
                f"gpu_memory_utilization: {config.gpu_memory_utilization} of the device "
                f"({_gib(memory.total)}) leaves nothing for the KV cache once others "
                f"({_gib(memory.used_by_others)}), the weights ({_gib(memory.weights)}) and the activations "
                f"({_gib(memory.activations + memory.non_torch)}) are counted; raise gpu_memory_utilization, "
                "lower max_num_batched_tokens or max_num_seqs, or free the device")
    elif device.type == "cuda":
        raise ValueError("plan_kv: sizing the KV pool on CUDA needs the measured memory (measure_memory)")
    else:
        n = CPU_DEFAULT_KV_BYTES // per_block
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


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _log_plan(config: EngineConfig, memory: DeviceMemory, per_block: int, blocks: int) -> None:
    log(config, f"memory plan: {config.gpu_memory_utilization} of {_gib(memory.total)}, less others "
                f"{_gib(memory.used_by_others)}, weights {_gib(memory.weights)}, activations "
                f"{_gib(memory.activations)}, outside torch {_gib(memory.non_torch)}: KV cache "
                f"{_gib(blocks * per_block)} ({blocks} blocks of {per_block} bytes)")


def start_tp_group(config: EngineConfig, cfg: ModelConfig, model_dir: str, dtype: torch.dtype,
                   device: torch.device, backend: AttentionBackend, max_positions: int,
                   quantization: str | None, measures: bool = False) -> TPGroup | None:
    """With `tensor_parallel_size` > 1 and no torch.distributed group yet: start this engine's
    other ranks (workers/tp_group.py); None otherwise (one rank, or a torchrun's ranks).
    `measures`: the KV pool is sized from measured memory, every rank measuring its own device."""
    size = config.tensor_parallel_size
    if size == 1 or (torch.distributed.is_initialized() and not tp_group_running()):
        return None
    check_shardable(cfg, size)
    if device.type == "cuda":  # rank 0 on the first of its ranks' GPUs (workers/tp_devices.py)
        check_rank_devices(device, size, torch.cuda.device_count())
        torch.cuda.set_device(rank_device(device, 0))  # `cuda` names no index, which set_device needs
    if config.cpu_lending or config.cpu_turns:
        raise ValueError("tensor_parallel_size: more than 1 does not share cores by lending or turns")
    log(config, f"starting {size - 1} tensor-parallel rank(s)")
    spec = FollowerSpec(model_dir, _DTYPE_NAMES[dtype], str(device), backend.value, max_positions, quantization,
                        config.kv_cache_dtype, config.block_size, config.max_num_batched_tokens, config.seed,
                        # Shared-memory collectives are for CPU tensors; on GPUs NCCL reduces.
                        shm_slot_bytes=_shm_slot_bytes(config, cfg, size, dtype) if device.type == "cpu" else 0,
                        shape=memory_plan.ProfileShape.of(config).encode(), measure=measures)
    return TPGroup(size, spec)


# The logits' gather goes through shared memory up to this many bytes a rank (a larger one, a
# batch of many rows of a large vocabulary, through gloo): it bounds the shared file.
_SHM_LOGITS_BYTES = 32 << 20


def _shm_slot_bytes(config: EngineConfig, cfg: ModelConfig, size: int, dtype: torch.dtype) -> int:
    """A rank's slot in the shared-memory collectives: a step's hidden states (in `dtype`), or its
    float32 logits' shard up to _SHM_LOGITS_BYTES."""
    rows = max(256, config.max_num_seqs * (1 + config.num_speculative_tokens))
    logits = min(rows * -(-cfg.vocab_size // size) * 4, _SHM_LOGITS_BYTES)
    hidden = config.max_num_batched_tokens * cfg.hidden_size * torch.finfo(dtype).bits // 8
    return -(-max(hidden, logits) // 64) * 64


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def plan_threads(config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, tp_group: TPGroup | None,
                 has_steps: Callable[[], bool]) -> tuple[int, CpuLending | None, tuple[int, ...]]:
    """The torch threads an engine steps on, its lending of the node's cores (if any) and the
    thread counts it compiles for. Engines that lend each other a node's cores step at two
    thread counts; each has its own graphs. Sets torch's thread count where it changes."""
    threads = torch.get_num_threads()
    cores = node_cores()
    worth_lending = bool(config.cpu_lending) and _worth_lending(config, model, dtype)
    if config.cpu_lending and not worth_lending and config.cpu_split_threads:
        # A small model steps on the split share, which may leave the serving plane a core.
        threads = config.cpu_split_threads
        torch.set_num_threads(threads)
    lending = (CpuLending(config.cpu_lending, threads, cores, has_steps)
               if config.cpu_lending and worth_lending and cores > threads else None)
    thread_counts = lending.thread_counts if lending else (threads,)
    if tp_group is not None:  # the ranks split the engine's cores (each steps on its part)
        threads = max(1, threads // tp_group.tp.size)
        torch.set_num_threads(threads)
        thread_counts = (threads,)
    return threads, lending, thread_counts


def _worth_lending(config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
    """Whether a second core pays for this model's steps: its weights take at least
    `cpu_lending_min_weight_bytes`. Every worker of an app loads the same model and
    decides alike, so one under the floor takes no locks at all (they cost a few
    percent of a small model's steps)."""
    weights = num_parameters(model) * dtype.itemsize
    if weights >= config.cpu_lending_min_weight_bytes:
        return True
    log(config, f"weights {weights / 2**20:.1f} MiB, under the "
                f"{config.cpu_lending_min_weight_bytes / 2**20:.0f} MiB that lending needs: "
                "stepping on this worker's share of the cores only")
    return False


def compile_runner(config: EngineConfig, runner: ModelRunner, backend: AttentionBackend, max_model_len: int,
                   thread_counts: tuple[int, ...] = ()) -> None:
    """Unless `enforce_eager`: run `runner`'s model through its compiled graph,
    compiled and warmed up now (CPU; eager where that is not possible), for each of
    `thread_counts` the engine steps at (default: this thread's)."""
    if config.enforce_eager:
        return
    # With tensor-parallel ranks a failed compile is the engine's failure, not a fallback to eager:
    # the ranks' collectives must stay in step, and a rank's warm-up may have failed in one.
    # The warm-up's positions stay inside the context (the rotary table): a block larger than
    # max_model_len took them past it, and the compiled kernel's bounds check aborted the process.
    forward = compile_forward(runner.model, backend, runner.kv_caches, config.block_size,
                              min(config.max_num_batched_tokens, max_model_len), runner.device,
                              lambda msg: log(config, msg), thread_counts, fallback=runner.tp_group is None)
    if forward is not None:
        runner.forward = forward


def prepare_attention(config: EngineConfig, backend: AttentionBackend, device: torch.device) -> None:
    """Build the CPU decode attention op now, at engine start, not in the first request's step (a
    first build takes ~20 s; later starts load it from torch's extension cache)."""
    if device.type == "cpu" and backend is AttentionBackend.TORCH and cpu_decode.enabled():
        log(config, "preparing the CPU decode attention op")
        cpu_decode.load()


def make_speculator(config: EngineConfig, draft: LlamaForCausalLM | None, dtype: torch.dtype,
                    device: torch.device, backend: AttentionBackend, kv_blocks: int,
                    max_model_len: int, thread_counts: tuple[int, ...] = (),
                    vocab_size: int | None = None) -> Speculator | None:
    """The speculator `config.speculative` asks for (None: no speculative decoding);
    `draft`: the draft model `load_draft` loaded; `vocab_size`: the target's (its logits' width)."""
    proposer: Proposer
    if config.speculative is SpeculativeMethod.NGRAM:
        proposer = NgramProposer(config.spec_ngram_min, config.spec_ngram_max, config.num_speculative_tokens)
    elif config.speculative is SpeculativeMethod.DRAFT:
        assert draft is not None, "speculative='draft' without its model (load_draft)"
        proposer = DraftModelProposer(draft, dtype, device, kv_blocks, config.block_size, max_model_len,
                                      config.max_num_batched_tokens, config.max_num_seqs, vocab_size)
        compile_runner(config, proposer.runner, backend, max_model_len, thread_counts)
    else:
        return None
    return Speculator(config, proposer, max_model_len)


_log = logging.getLogger(__name__)


def log(config: EngineConfig, msg: str) -> None:
    """Progress of long work (model load, compiling), when the config asks for it."""
    _log.info("%s", msg)
    if config.progress:
        print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
