"""Engine configuration: one frozen dataclass, validated where it is built."""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any

from pdserve.kernels.attention import AttentionBackend


class DType(str, enum.Enum):
    AUTO = "auto"  # CPU: bfloat16 where native (AMX/AVX512-BF16), else float32; CUDA: the checkpoint's
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class SpeculativeMethod(str, enum.Enum):
    NGRAM = "ngram"  # prompt lookup: drafts copied from earlier in the sequence
    DRAFT = "draft"  # a small model's drafts (`draft_model`)


# Fields given as strings (flags, YAML, `LLM(dtype="float16")`) become these enums.
_ENUMS: dict[str, type[enum.Enum]] = {
    "dtype": DType, "speculative": SpeculativeMethod, "attention_backend": AttentionBackend}


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs. `model` is an HF-format directory.

    KV pool size: `num_kv_blocks` if given, else `kv_cache_memory` bytes, else
    (CUDA) what is left of `gpu_memory_utilization` of the device once other
    processes, the weights (target and draft) and a profile step's activations are
    counted, or (CPU) 4 GiB; a block holds the target's and the draft's KV
    (docs/engine.md, "Memory plan").
    """

    model: str
    tokenizer: str | None = None
    # auto: bfloat16 on a CPU that computes it natively (AMX or AVX512-BF16, as vLLM's CPU build
    # chooses), else float32; on CUDA the checkpoint's half dtype. PDSERVE_DTYPE sets the default
    # (the test suite pins float32: its oracles are float32, and its outcome must not depend on
    # which CPU the CI machine has).
    dtype: DType = dataclasses.field(default_factory=lambda: os.environ.get("PDSERVE_DTYPE", "auto"))  # type: ignore[assignment]
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max positions
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    record_kv_events: bool = False  # keep block stored/evicted events for a router to drain
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    # Speculative decoding: None (off), n-gram lookup or a draft model, up to
    # `num_speculative_tokens` per step, verified exactly by the target in one pass.
    speculative: SpeculativeMethod | None = None
    draft_model: str | None = None  # HF-format directory of the draft (speculative="draft"); same tokenizer
    num_speculative_tokens: int = 4
    spec_ngram_min: int = 1  # shortest suffix that may match (vLLM: prompt_lookup_min)
    spec_ngram_max: int = 4  # longest suffix tried (vLLM: prompt_lookup_max)
    # Adaptive draft length: the i-th draft of a request is made only while its
    # chance of acceptance, (rolling acceptance rate)^i, is at least the token
    # cost: the price of a draft (extra verification time + proposing it)
    # relative to what a plain decode step spends per sequence. None: measured
    # while serving (workers/spec/cost.py); a number in (0, 1) pins it.
    # No drafts at all while more than `spec_max_batch_size` requests decode: a
    # big batch is compute-bound, so verification is no longer free
    # (docs/speculative.md has the measurements behind the default).
    spec_token_cost: float | None = None
    spec_max_batch_size: int = 2
    # vLLM's name: True runs the model op by op. False (default) compiles it with
    # torch.compile at start (CPU; workers/model/compiled.py). The environment
    # variable PDSERVE_ENFORCE_EAGER=1 flips the default (the test suite sets it:
    # compiling every tiny engine would cost more than the tests run).
    enforce_eager: bool = dataclasses.field(default_factory=lambda: os.environ.get("PDSERVE_ENFORCE_EAGER") == "1")
    seed: int = 0
    progress: bool = False
    # A lock file that engines sharing this machine's cores take turns with, each step's model
    # work on all of them in its turn (workers/cpu_turns.py); None: no turns. Set by the
    # cluster for CPU workers that share a node (cluster/placement.py), not by users.
    cpu_turns: str | None = None
    # A directory through which engines sharing this machine's cores lend them: each step
    # on all of them while the others are idle, on this thread's share otherwise
    # (workers/cpu_lending.py); None: no lending. Set by the cluster, like cpu_turns.
    cpu_lending: str | None = None
    # Engines lend only for a model whose weights take at least this many bytes
    # (cluster/placement.py, `--cpu-sharing auto`); under it they step on their share,
    # as split. Set by the cluster.
    cpu_lending_min_weight_bytes: int = 0
    # The threads an engine configured to lend steps on when its model is under that floor
    # (0: the threads it was given): a colocated pool's split share, which leaves the serving
    # plane a core (cluster/placement.py). Set by the cluster.
    cpu_split_threads: int = 0

    def __post_init__(self) -> None:
        for name, kind in _ENUMS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                object.__setattr__(self, name, enum_member(name, kind, value))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: must be a non-empty path, got {self.model!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens",
                     "spec_ngram_min", "spec_ngram_max"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if (self.speculative is SpeculativeMethod.DRAFT) != (self.draft_model is not None):
            raise ValueError("draft_model: give it exactly when speculative is draft")
        if self.spec_token_cost is not None and not 0.0 < self.spec_token_cost < 1.0:
            raise ValueError(f"spec_token_cost: must be in (0, 1), got {self.spec_token_cost}")
        if type(self.spec_max_batch_size) is not int or self.spec_max_batch_size < 0:
            raise ValueError(f"spec_max_batch_size: must be an integer >= 0, got {self.spec_max_batch_size!r}")
        if self.cpu_turns is not None and (not isinstance(self.cpu_turns, str) or not self.cpu_turns):
            raise ValueError(f"cpu_turns: must be a lock file's path or None, got {self.cpu_turns!r}")
        if self.cpu_lending is not None and (not isinstance(self.cpu_lending, str) or not self.cpu_lending):
            raise ValueError(f"cpu_lending: must be a directory's path or None, got {self.cpu_lending!r}")
        if type(self.cpu_lending_min_weight_bytes) is not int or self.cpu_lending_min_weight_bytes < 0:
            raise ValueError("cpu_lending_min_weight_bytes: must be an integer >= 0, "
                             f"got {self.cpu_lending_min_weight_bytes!r}")
        if type(self.cpu_split_threads) is not int or self.cpu_split_threads < 0:
            raise ValueError(f"cpu_split_threads: must be an integer >= 0, got {self.cpu_split_threads!r}")
        if self.cpu_turns is not None and self.cpu_lending is not None:
            raise ValueError("cpu_turns, cpu_lending: an engine takes turns or lends, not both")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: must be true or false, got {self.enforce_eager!r}")
        if self.spec_ngram_max < self.spec_ngram_min:
            raise ValueError(f"spec_ngram_max: must be >= spec_ngram_min ({self.spec_ngram_min}), "
                             f"got {self.spec_ngram_max}")

    @classmethod
    def settings(cls) -> frozenset[str]:
        """The fields a user sets (flags, YAML, `LLM(...)`); the rest are the workers' own."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - {"record_kv_events", "progress", "cpu_turns",
                                                                   "cpu_lending", "cpu_lending_min_weight_bytes",
                                                                   "cpu_split_threads"}


def enum_member(name: str, kind: type[enum.Enum], value: Any) -> enum.Enum:
    """`kind(value)`, or a ValueError naming the setting and its choices."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise ValueError(f"{name}: must be one of {choices}, got {value!r}") from None


def _positive_int(name: str, value: Any) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
