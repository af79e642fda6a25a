"""A performance profile: what one worker's steps and one KV handoff cost on the
hardware it was measured on (the points `pdserve profile` measured, with the
machine, model and engine settings they came from). costs.py fits the cost
models the simulator reads from it.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

if TYPE_CHECKING:
    from pdserve.cluster.planner.costs import CostModel

PROFILE_VERSION = 1
MIN_POINTS = 3  # prefill points, and decode points, a profile needs (the cost models' coefficients)


class MachineInfo(TypedDict):
    """What the numbers depend on (`machine_info`), for the reader of a profile."""

    cpu: str
    cores: int | None
    device: str
    python: str
    torch: NotRequired[str]
    gpu: NotRequired[str]  # a CUDA device's name


class ModelInfo(TypedDict):
    """The model profiled: where it was loaded from, what it is served as, its shape."""

    path: str
    name: str
    architecture: str
    layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    parameters: int


class PointAt(TypedDict, total=False):
    """Where a measured point is: a prefill point's new and cached tokens, a decode point's batch and context."""

    new: int
    cached: int
    batch: int
    context: int


class Spread(PointAt):
    """A measured point's noise: the min and max of its `n` repeats."""

    kind: str  # prefill or decode
    min: float
    max: float
    n: int


class LoadAverage(TypedDict):
    before: tuple[float, float, float]  # os.getloadavg() as the measurements started and ended
    after: tuple[float, float, float]


class ProfileNotes(TypedDict, total=False):
    """How the profile was measured, for the reader (the simulator reads none of it)."""

    grid: dict[str, object]  # the points asked for (profiler.Grid's fields)
    skipped: list[str]  # points left out, and why
    spread: list[Spread]
    decode_warmup_steps: int
    load_average: LoadAverage
    spec_max_batch_size: int  # decode steps up to this batch verify drafts
    command: str  # the command that measured it
    seconds: float  # how long it took


@dataclass(frozen=True)
class PrefillPoint:
    """One step that prefilled `new_tokens` of one prompt after `cached_tokens` already in KV."""

    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    """One decode step of `batch` sequences whose contexts average `context` tokens."""

    batch: int
    context: int
    seconds: float


@dataclass(frozen=True)
class TransferPoint:
    """One request's KV handed from a prefill worker to a decode worker: `bytes` in `seconds`."""

    bytes: int
    seconds: float


@dataclass(frozen=True)
class SpecProfile:
    """Speculative decoding as measured: tokens a sequence gains per decode step (1.0 without)."""

    method: str
    num_speculative_tokens: int
    acceptance_rate: float
    tokens_per_step: float


@dataclass(frozen=True)
class EngineShape:
    """The engine settings the profile was measured with (the simulator batches the same way)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    max_model_len: int
    torch_threads: int
    dtype: str
    device: str
    enable_prefix_caching: bool = True
    # The worker's ranks (devices): a profile of a TP=N worker plans it as one worker of N devices.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        # A hand-edited file's settings: "16" failed in the simulator's arithmetic with a TypeError
        # traceback, and 4096.5 blocks or a null thread count were planned on.
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len",
                     "torch_threads", "tensor_parallel_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"engine.{name}: a whole number >= 1, got {value!r}")


@dataclass(frozen=True)
class Profile:
    machine: MachineInfo
    model: ModelInfo
    engine: EngineShape
    transport: str
    kv_bytes_per_token: int
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    transfer: tuple[TransferPoint, ...]
    speculative: SpecProfile | None = None
    # CPU seconds per streamed token outside the workers on the serving host (gateway,
    # HAProxy, a local client): None takes costs.DEFAULT_SERVING_CPU_PER_TOKEN_S (measured,
    # see there). Only a CPU profile's simulation uses it.
    serving_cpu_per_token_s: float | None = None
    created: str = ""
    version: int = PROFILE_VERSION
    notes: ProfileNotes = field(default_factory=ProfileNotes)

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version}: this pdserve reads version {PROFILE_VERSION}")
        if len(self.prefill) < MIN_POINTS or len(self.decode) < MIN_POINTS:
            raise ValueError(f"profile: needs >= {MIN_POINTS} prefill and >= {MIN_POINTS} decode points, has "
                             f"{len(self.prefill)} and {len(self.decode)}")
        points: tuple[PrefillPoint | DecodePoint | TransferPoint, ...] = (*self.prefill, *self.decode, *self.transfer)
        for p in points:
            if not p.seconds > 0:
                raise ValueError(f"profile: a point with a non-positive time: {p}")

    # -- JSON -----------------------------------------------------------------

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> Profile:
        """`d`: a profile file's JSON, as parsed (a ValueError if it is not one). Its machine,
        model and notes are for the reader and taken as they are (an older file may lack a key)."""
        if not isinstance(d, dict):  # valid JSON of another shape: `d.get` would raise AttributeError
            raise ValueError(f"not a pdserve profile: a JSON {type(d).__name__}, not an object")
        try:
            spec = d.get("speculative")
            return cls(machine=cast(MachineInfo, dict(d["machine"])), model=cast(ModelInfo, dict(d["model"])),
                       engine=EngineShape(**d["engine"]),
                       transport=str(d["transport"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                       prefill=tuple(PrefillPoint(**p) for p in d["prefill"]),
                       decode=tuple(DecodePoint(**p) for p in d["decode"]),
                       transfer=tuple(TransferPoint(**p) for p in d["transfer"]),
                       speculative=SpecProfile(**spec) if spec else None,
                       serving_cpu_per_token_s=(None if d.get("serving_cpu_per_token_s") is None
                                                else float(d["serving_cpu_per_token_s"])),
                       created=str(d.get("created", "")),
                       version=int(d.get("version", PROFILE_VERSION)),
                       notes=cast(ProfileNotes, dict(d.get("notes", {}))))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pdserve profile: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from e
        return cls.from_json(d)

    def costs(self) -> CostModel:
        from pdserve.cluster.planner.costs import CostModel

        return CostModel.fit(self)


def machine_info(device: str) -> MachineInfo:
    """What the numbers depend on, for the reader of a profile."""
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: MachineInfo = {"cpu": cpu, "cores": os.cpu_count(), "device": device, "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info
