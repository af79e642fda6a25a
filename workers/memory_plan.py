"""Measuring what a GPU engine's memory plan is computed from (docs/engine.md, "Memory plan").

The arithmetic is `kv_budget_bytes` (workers/kv/cache.py), a pure function of a `DeviceMemory`;
this module measures one: a `MemoryProbe` taken before the engine allocates anything (how much
of the device others use), then, once the target's and the draft's weights are loaded, the
profile steps: one prefill step of `max_num_batched_tokens` tokens over `max_num_seqs`
sequences that all sample (top-k, top-p, min-p and logprobs: the sampler's largest path) and,
with speculative decoding, one step that verifies `num_speculative_tokens` drafts per sequence
(its `[rows, vocab]` logits can be the largest tensors of all), each over a KV pool just big
enough for it, freed afterwards. The peak of what torch holds above what it held before the
step (the weights and that pool) is the step's activations.

The probe is a protocol so that tests fake it on CPU; `CudaMemoryProbe` is the real one.

Tensor-parallel ranks each measure their own device, every rank running the same profile steps
(their collectives pair up); the plan is the tightest rank's (`tightest`), since every rank
holds as many blocks (workers/kv/cache.py `tightest`, workers/tp_group.py `exchange_memory`).
NOT MEASURED ON A GPU YET: no line of this has run on CUDA (docs/engine.md says so too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.workers.config import EngineConfig, SpeculativeMethod
from pdserve.workers.cuda_graphs import MAX_BUCKET
from pdserve.workers.kv.cache import DeviceMemory, allocate_kv_caches
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model_runner import ModelRunner
from pdserve.workers.request import Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.scheduler import ScheduledRequest


class MemoryProbe(Protocol):
    """What the plan reads of a device. `total` and `used_at_start` are read when the probe is
    made, which must be before the engine allocates anything there."""

    total: int
    used_at_start: int  # total - free at that moment: other processes, and this one's CUDA context

    def held(self) -> int:
        """Bytes torch holds on the device now."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak: from here `peak()` is the most `held()` reached."""
        ...

    def peak(self) -> int: ...

    def non_torch(self) -> int:
        """Bytes in use on the device now beyond `used_at_start` that torch's allocator does not
        hold (cuBLAS workspaces, NCCL buffers, ...)."""
        ...

    def empty_cache(self) -> None:
        """Give the blocks torch caches but does not use back to the device."""
        ...


class ProfileSettings(Protocol):
    """The engine settings the profile steps follow: an EngineConfig, or a follower rank's
    ProfileShape of one."""

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def speculative(self) -> SpeculativeMethod | None: ...
    @property
    def enforce_eager(self) -> bool: ...


@dataclass(frozen=True)
class ProfileShape:
    """An EngineConfig's ProfileSettings as plain data (it reaches a follower rank as JSON)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_speculative_tokens: int
    speculative: SpeculativeMethod | None
    enforce_eager: bool

    @classmethod
    def of(cls, config: EngineConfig) -> ProfileShape:
        return cls(config.max_num_seqs, config.max_num_batched_tokens, config.block_size,
                   config.num_speculative_tokens, config.speculative, config.enforce_eager)

    def encode(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "speculative": self.speculative.value if self.speculative else None}

    @classmethod
    def decode(cls, d: dict[str, Any]) -> ProfileShape:
        method = d["speculative"]
        return cls(**{**d, "speculative": SpeculativeMethod(method) if method is not None else None})


class CudaMemoryProbe:
    """The probe on a CUDA device, from torch.cuda's allocator statistics and cudaMemGetInfo.

    What torch holds is its caching allocator's *reserved* memory (max_memory_reserved for the
    peak), not what its tensors have allocated (max_memory_allocated): the segments it caches
    are what the device has lost, and the allocated figures leave fragmentation out. Each
    profile step starts from an empty cache, so its peak counts only the segments it needed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        free, self.total = torch.cuda.mem_get_info(device)
        self.used_at_start = self.total - free

    def held(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))

    def non_torch(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - self.used_at_start - int(torch.cuda.memory_reserved(self.device)))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def measure(config: ProfileSettings, probe: MemoryProbe, model: LlamaForCausalLM, draft: LlamaForCausalLM | None,
            dtype: torch.dtype, device: torch.device, max_model_len: int) -> DeviceMemory:
    """The device's memory as the plan needs it. Call once the weights (target and draft) are
    loaded and before anything else is allocated on the device."""
    weights = probe.held()
    spec_k = config.num_speculative_tokens if config.speculative is not None else 0
    activations = profile_step(config, probe, model, dtype, device, max_model_len, verify=spec_k,
                               draft_probs=config.speculative is SpeculativeMethod.DRAFT)
    if draft is not None:
        activations = max(activations, profile_step(config, probe, draft, dtype, device, max_model_len,
                                                    want_probs=True))
    if not config.enforce_eager:
        # CUDA graphs (workers/cuda_graphs.py) are captured after the pool is sized and keep a
        # private pool of their largest bucket's activations: reserved here, scaled from the
        # profile by tokens (an overestimate: the graphs hold no logits or sampling).
        top = min(config.max_num_seqs, MAX_BUCKET, config.max_num_batched_tokens) * (1 + spec_k)
        activations += int(activations * min(1.0, top / profile_tokens(config, max_model_len, spec_k)))
    probe.empty_cache()
    return DeviceMemory(total=probe.total, used_by_others=probe.used_at_start, weights=weights,
                        activations=activations, non_torch=probe.non_torch())


# The sampler's largest path (sort for top-p, masks for top-k and min-p, log-softmax for logprobs).
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=5, max_tokens=None)


def profile_tokens(config: ProfileSettings, max_model_len: int, verify: int = 0) -> int:
    """Tokens of the largest real prefill step: the budget, or max_num_seqs sequences if they hold
    fewer. No step computes more of a sequence than its prompt (under max_model_len), then its
    sampled token and drafts: a profile sequence past that would run positions the model's RoPE
    tables (max_model_len rows) do not have."""
    return min(config.max_num_batched_tokens, config.max_num_seqs * max(1, max_model_len - 1 - verify))


@torch.inference_mode()
def profile_step(config: ProfileSettings, probe: MemoryProbe, model: LlamaForCausalLM, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, verify: int = 0, draft_probs: bool = False,
                 want_probs: bool = False) -> int:
    """Peak activation bytes of `model`'s largest steps: a prefill of `max_num_batched_tokens`
    tokens over `max_num_seqs` sequences, all sampled, and (`verify` > 0) a step in which each
    sequence verifies `verify` drafts (with the draft's [k, vocab] distributions when
    `draft_probs`). Over a throw-away KV pool just big enough; the runner's input buffers (about
    as big as the engine's own, which come later) count as activations."""
    cfg, bs = model.config, config.block_size
    tokens = profile_tokens(config, max_model_len, verify)
    seqs = max(1, min(config.max_num_seqs, tokens))
    lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    # Room for each sequence's prompt, its sampled token and `verify` drafts.
    num_blocks = sum(-(-(n + 1 + verify) // bs) for n in lens)
    probe.empty_cache()
    caches = allocate_kv_caches(cfg, num_blocks, bs, dtype, device)
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=False)
    base = probe.held()  # the weights and this throw-away pool: not activations
    runner = ModelRunner(model, caches, kv, config.max_num_batched_tokens, config.max_num_seqs,
                         max(max_model_len, max(lens) + 1 + verify), device)
    reqs = [Request(f"profile-{i}", [(7 * i + j) % cfg.vocab_size for j in range(n)], _PROFILE_PARAMS,
                    max_tokens=1 + verify, device=device) for i, n in enumerate(lens)]
    probe.reset_peak()
    for r in reqs:
        kv.allocate_slots(r, r.num_tokens)
    result = runner.execute([ScheduledRequest(r, r.num_tokens) for r in reqs], want_probs=want_probs)
    peak = probe.peak()
    if verify:
        # One decode step that verifies `verify` drafts for as many sequences as the token budget holds.
        step = reqs[: max(1, min(seqs, tokens // (verify + 1)))]
        sampled = result.output.token_ids.tolist()
        del result
        scheduled = []
        for r, token in zip(step, sampled):
            r.num_computed_tokens = r.num_tokens
            r.append_token(token)
            r.spec_token_ids = [(token + 1 + j) % cfg.vocab_size for j in range(verify)]
            if draft_probs:
                r.spec_draft_probs = torch.full((verify, cfg.vocab_size), 1.0 / cfg.vocab_size, device=device)
            kv.allocate_slots(r, 1 + verify)
            scheduled.append(ScheduledRequest(r, 1 + verify, num_spec=verify))
        runner.execute(scheduled)
        peak = max(peak, probe.peak())
    del runner, caches, reqs
    return max(0, peak - base)
