"""Engine configuration: one frozen dataclass, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs. `model` is an HF-format directory.

    KV pool size: `num_kv_blocks` if given, else `kv_cache_memory` bytes, else
    (CUDA) `gpu_memory_utilization` of the device minus weights and activations,
    or (CPU) 256 MiB.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on CUDA
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
    attention_backend: str = "auto"
    # Speculative decoding: None (off), "ngram" (prompt lookup: drafts copied
    # from earlier in the sequence) or "draft" (a small model's greedy drafts),
    # up to `num_speculative_tokens` per step, verified exactly by the target in one pass.
    speculative: str | None = None
    draft_model: str | None = None  # HF-format directory of the draft (speculative="draft"); same tokenizer
    num_speculative_tokens: int = 4
    spec_ngram_min: int = 1  # shortest suffix that may match (vLLM: prompt_lookup_min)
    spec_ngram_max: int = 4  # longest suffix tried (vLLM: prompt_lookup_max)
    # Adaptive draft length: the i-th draft of a request is made only while its
    # chance of acceptance, (rolling acceptance rate)^i, is at least the token
    # cost: the price of a draft (extra verification time + proposing it)
    # relative to what a plain decode step spends per sequence. None: measured
    # while serving (workers/spec/cost.py); a number in (0, 1) pins it.
    # No drafts at all while more than `spec_max_batch_size` requests decode (a
    # big batch is compute-bound: verification is no longer free). Measured on
    # the 2-core CPU (bench/spec_decode.py, docs/speculative.md): n-gram paid
    # 1.3-1.5x at batch 1 and lost (0.73-0.85x) from batch 4 up.
    spec_token_cost: float | None = None
    spec_max_batch_size: int = 2
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be > 0, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be > 0, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype: must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative: must be None, ngram or draft, got {self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model: give it exactly when speculative is draft")
        for name in ("num_speculative_tokens", "spec_ngram_min", "spec_ngram_max"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.spec_token_cost is not None and not 0.0 < self.spec_token_cost < 1.0:
            raise ValueError(f"spec_token_cost: must be in (0, 1), got {self.spec_token_cost}")
        if not isinstance(self.spec_max_batch_size, int) or self.spec_max_batch_size < 0:
            raise ValueError(f"spec_max_batch_size: must be an integer >= 0, got {self.spec_max_batch_size!r}")
        if self.spec_ngram_max < self.spec_ngram_min:
            raise ValueError(f"spec_ngram_max: must be >= spec_ngram_min ({self.spec_ngram_min}), got {self.spec_ngram_max}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend: must be auto, torch or triton, got {self.attention_backend!r}")
