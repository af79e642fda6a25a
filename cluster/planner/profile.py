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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.cluster.planner.costs import CostModel

PROFILE_VERSION = 1


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


@dataclass(frozen=True)
class Profile:
    machine: dict[str, Any]
    model: dict[str, Any]
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
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version}: this pdserve reads version {PROFILE_VERSION}")
        if len(self.prefill) < 3 or len(self.decode) < 3:
            raise ValueError(f"profile: needs >= 3 prefill and >= 3 decode points, has {len(self.prefill)} "
                             f"and {len(self.decode)}")
        points: tuple[PrefillPoint | DecodePoint | TransferPoint, ...] = (*self.prefill, *self.decode, *self.transfer)
        for p in points:
            if not p.seconds > 0:
                raise ValueError(f"profile: a point with a non-positive time: {p}")

    # -- JSON -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Profile:
        try:
            spec = d.get("speculative")
            return cls(machine=dict(d["machine"]), model=dict(d["model"]), engine=EngineShape(**d["engine"]),
                       transport=str(d["transport"]), kv_bytes_per_token=int(d["kv_bytes_per_token"]),
                       prefill=tuple(PrefillPoint(**p) for p in d["prefill"]),
                       decode=tuple(DecodePoint(**p) for p in d["decode"]),
                       transfer=tuple(TransferPoint(**p) for p in d["transfer"]),
                       speculative=SpecProfile(**spec) if spec else None,
                       serving_cpu_per_token_s=(None if d.get("serving_cpu_per_token_s") is None
                                                else float(d["serving_cpu_per_token_s"])),
                       created=str(d.get("created", "")),
                       version=int(d.get("version", PROFILE_VERSION)), notes=dict(d.get("notes", {})))
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


def machine_info(device: str) -> dict[str, Any]:
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
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "device": device, "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info
