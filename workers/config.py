"""Engine configuration: one frozen pydantic dataclass, validated where it is built.

Configs here and in cluster/serve_config.py are declared with `CONFIG`: a field
takes what its annotation says and nothing it would have to guess at (2 for an
int, not "2", 2.0 or True; an int for a float; no NaN or infinity), an enum
field its member or its value (flags and YAML give strings), and the bounds are
the annotations' (`PositiveInt`, `Field(gt=0, le=1)`); a check across fields is
one `model_validator`. A bad value raises a ValueError that starts with the
setting's name (`named_errors`), not pydantic's ValidationError report.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    Strict,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails

from pdserve.kernels.backend_choice import AttentionBackend

CONFIG = ConfigDict(strict=True, allow_inf_nan=False, validate_default=True, arbitrary_types_allowed=True)
# An enum setting: its member, or its value ("float16" for DType.FLOAT16).
ByValue = Strict(False)
NonEmpty = Annotated[str, Field(min_length=1)]
NotBlank = Annotated[str, Field(pattern=r"\S")]  # more than white space
Seconds = Annotated[float, Field(gt=0)]  # a timeout: finite (CONFIG), so every wait has a deadline


class DType(str, enum.Enum):
    AUTO = "auto"  # CPU: bfloat16 where native (AMX/AVX512-BF16), else float32; CUDA: the checkpoint's
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class SpeculativeMethod(str, enum.Enum):
    NGRAM = "ngram"  # prompt lookup: drafts copied from earlier in the sequence
    DRAFT = "draft"  # a small model's drafts (`draft_model`)


def _device(value: str) -> str:
    """auto, cpu, cuda or cuda:N: what torch.device takes here. Another string passed the config
    and failed in the worker's start (a RuntimeError, after Ray was up)."""
    kind, sep, index = value.partition(":")
    if value in ("auto", "cpu") or (kind == "cuda" and (not sep or index.isdigit())):
        return value
    raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")
    return value


def _env(name: str, default: str) -> Any:
    """A default from the environment, validated as a value given (a bad one is named as the field's)."""
    return os.environ.get(name, default)


_T = TypeVar("_T")


def named_errors(names: Mapping[str, str] | None = None) -> Callable[[type[_T]], type[_T]]:
    """A class decorator for a pydantic dataclass: building it raises a ValueError whose every line
    starts with a setting's name ("block_size: must be a power of two, got 24"), in place of the
    ValidationError. `names`: field -> setting, where the setting is named otherwise. A field kept
    out of the repr (a key) is kept out of its error too."""
    setting = dict(names or {})

    def decorate(cls: type[_T]) -> type[_T]:
        validate = cls.__init__
        hidden = {f.name for f in dataclasses.fields(cls) if not f.repr}  # type: ignore[arg-type]

        @functools.wraps(validate)
        def __init__(self: _T, *args: Any, **kwargs: Any) -> None:
            try:
                validate(self, *args, **kwargs)
            except ValidationError as e:
                raise ValueError("\n".join(_explain(error, setting, hidden) for error in e.errors())) from None

        setattr(cls, "__init__", __init__)  # noqa: B010 - mypy does not let a method be assigned
        return cls

    return decorate


# Pydantic's messages for the ways a value can fail its annotation, in the words errors here use.
_WORDING = {
    "int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be true or false",
    "string_type": "must be a string", "tuple_type": "must be a list", "dict_type": "must be a mapping",
    "enum": "must be one of {expected}", "finite_number": "must be a finite number",
    "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}", "less_than_equal": "must be <= {le}",
    "string_too_short": "must not be empty", "too_short": "must not be empty",
    "string_pattern_mismatch": "must not be blank",  # NotBlank's pattern, the one pattern here
}


def _explain(error: ErrorDetails, setting: Mapping[str, str], hidden: set[str]) -> str:
    field = str(error["loc"][0]) if error["loc"] else None  # none: a check across fields, which names its own
    if error["type"] == "value_error":  # a validator's own words (the value in them)
        text = str(error.get("ctx", {}).get("error", error["msg"]))
    else:
        wording = _WORDING.get(error["type"])
        text = wording.format(**error.get("ctx", {})) if wording else error["msg"]
        if field not in hidden:
            text += f", got {error['input']!r}"
    if field is None:
        return text
    name = setting.get(field, field)
    return text if text.startswith(f"{name}:") else f"{name}: {text}"


@named_errors()
@dataclass(frozen=True, config=CONFIG)
class EngineConfig:
    """Everything `LLMEngine` needs. `model` is an HF-format directory.

    KV pool size: `num_kv_blocks` if given, else `kv_cache_memory` bytes, else
    (CUDA) what is left of `gpu_memory_utilization` of the device once other
    processes, the weights (target and draft) and a profile step's activations are
    counted, or (CPU) 4 GiB; a block holds the target's and the draft's KV
    (docs/engine.md, "Memory plan").
    """

    model: NotBlank
    tokenizer: NotBlank | None = None  # None: the model directory's
    # auto: bfloat16 on a CPU that computes it natively (AMX or AVX512-BF16, as vLLM's CPU build
    # chooses), else float32; on CUDA the checkpoint's half dtype. PDSERVE_DTYPE sets the default
    # (the test suite pins float32: its oracles are float32, and its outcome must not depend on
    # which CPU the CI machine has).
    dtype: Annotated[DType, ByValue] = dataclasses.field(default_factory=lambda: _env("PDSERVE_DTYPE", "auto"))
    device: Annotated[str, AfterValidator(_device)] = "auto"  # auto: cuda if available, else cpu
    max_model_len: PositiveInt | None = None  # None: the model's max positions
    block_size: Annotated[PositiveInt, AfterValidator(_power_of_two)] = 16
    max_num_seqs: PositiveInt = 128
    # vLLM's name: the most log-probs (logprobs, prompt_logprobs) a request may ask for a token;
    # -1: the whole vocabulary (what distillation and RL clients ask for).
    max_logprobs: Annotated[int, Field(ge=-1)] = 20
    max_num_batched_tokens: PositiveInt = 2048
    # vLLM's name: True keeps a served worker's stats line (throughput, batch, queue, KV usage, prefix
    # hits, every 10 s while it works: workers/stats_log.py) out of its log. The offline engine
    # (`LLM`) logs none either way.
    disable_log_stats: bool = False
    num_kv_blocks: PositiveInt | None = None
    kv_cache_memory: PositiveInt | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    enable_prefix_caching: bool = True
    record_kv_events: bool = False  # keep block stored/evicted events for a router to drain
    attention_backend: Annotated[AttentionBackend, ByValue] = AttentionBackend.AUTO
    # Speculative decoding: None (off), n-gram lookup or a draft model, up to
    # `num_speculative_tokens` per step, verified exactly by the target in one pass.
    speculative: Annotated[SpeculativeMethod, ByValue] | None = None
    draft_model: NotBlank | None = None  # HF-format directory of the draft (speculative="draft"); same tokenizer
    num_speculative_tokens: PositiveInt = 4
    spec_ngram_min: PositiveInt = 1  # shortest suffix that may match (vLLM: prompt_lookup_min)
    spec_ngram_max: PositiveInt = 4  # longest suffix tried (vLLM: prompt_lookup_max)
    # Adaptive draft length: the i-th draft of a request is made only while its
    # chance of acceptance, (rolling acceptance rate)^i, is at least the token
    # cost: the price of a draft (extra verification time + proposing it)
    # relative to what a plain decode step spends per sequence. None: measured
    # while serving (workers/spec/cost.py); a number in (0, 1) pins it.
    # No drafts at all while more than `spec_max_batch_size` requests decode: a
    # big batch is compute-bound, so verification is no longer free
    # (docs/speculative.md has the measurements behind the default).
    spec_token_cost: Annotated[float, Field(gt=0, lt=1)] | None = None
    spec_max_batch_size: NonNegativeInt = 2
    # vLLM's name: True runs the model op by op. False (default) compiles it with
    # torch.compile at start (CPU; workers/model/compiled.py). The environment
    # variable PDSERVE_ENFORCE_EAGER=1 flips the default (the test suite sets it:
    # compiling every tiny engine would cost more than the tests run).
    enforce_eager: bool = dataclasses.field(default_factory=lambda: os.environ.get("PDSERVE_ENFORCE_EAGER") == "1")
    # vLLM's name: "fp8" quantizes the decoder's linear weights to e4m3 with per-channel scales
    # at load (workers/model/fp8.py); None: the checkpoint's own format (an fp8 checkpoint
    # loads as fp8 either way).
    quantization: Literal["fp8"] | None = None
    # vLLM's name: "fp8" (or "fp8_e4m3") keeps K and V in e4m3, half the bytes of a 16-bit cache
    # (and of a KV transfer), each layer's scaled by its checkpoint's k_scale/v_scale or 1.0;
    # "auto": the model's dtype (docs/quantization.md).
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    # vLLM's name: the next step is scheduled and its inputs staged while this one runs on the
    # device; sampled token ids feed the next step on the device and reach the host one step
    # later (workers/in_flight.py). None: on for CUDA, off on CPU (there the step is the host's
    # own work: nothing to overlap). Greedy tokens are the same either way.
    async_scheduling: bool | None = None
    # vLLM's name: the model's heads and MLP columns split over this many ranks, one process
    # each, in step (workers/model/tensor_parallel.py): processes the engine starts (workers/
    # tp_group.py; on GPUs rank r on the r-th GPU from the engine's), or the ranks of
    # torch.distributed's default group when the caller initialised it (torchrun); then every
    # rank runs the same requests and returns the same outputs.
    tensor_parallel_size: PositiveInt = 1
    # What torch.manual_seed takes (int64 or uint64): a seed beyond failed every worker's start
    # ("Overflow when unpacking long long") once Ray was up, instead of here, by name.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] = 0
    progress: bool = False
    # A lock file that engines sharing this machine's cores take turns with, each step's model
    # work on all of them in its turn (workers/cpu_turns.py); None: no turns. Set by the
    # cluster for CPU workers that share a node (cluster/placement.py), not by users.
    cpu_turns: NonEmpty | None = None
    # A directory through which engines sharing this machine's cores lend them: each step
    # on all of them while the others are idle, on this thread's share otherwise
    # (workers/cpu_lending.py); None: no lending. Set by the cluster, like cpu_turns.
    cpu_lending: NonEmpty | None = None
    # Engines lend only for a model whose weights take at least this many bytes
    # (cluster/placement.py, `--cpu-sharing auto`); under it they step on their share,
    # as split. Set by the cluster.
    cpu_lending_min_weight_bytes: NonNegativeInt = 0
    # The threads an engine configured to lend steps on when its model is under that floor
    # (0: the threads it was given): a colocated pool's split share, which leaves the serving
    # plane a core (cluster/placement.py). Set by the cluster.
    cpu_split_threads: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check_together(self) -> EngineConfig:
        if (self.speculative is SpeculativeMethod.DRAFT) != (self.draft_model is not None):
            raise ValueError("draft_model: give it exactly when speculative is draft")
        if self.spec_ngram_max < self.spec_ngram_min:
            raise ValueError(f"spec_ngram_max: must be >= spec_ngram_min ({self.spec_ngram_min}), "
                             f"got {self.spec_ngram_max}")
        if self.cpu_turns is not None and self.cpu_lending is not None:
            raise ValueError("cpu_turns, cpu_lending: an engine takes turns or lends, not both")
        return self

    @classmethod
    def settings(cls) -> frozenset[str]:
        """The fields a user sets (flags, YAML, `LLM(...)`); the rest are the workers' own."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - {"record_kv_events", "progress", "cpu_turns",
                                                                   "cpu_lending", "cpu_lending_min_weight_bytes",
                                                                   "cpu_split_threads"}
