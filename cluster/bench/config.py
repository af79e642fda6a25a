"""`BenchConfig`: every choice of a benchmark, validated once; the CLI builds it from flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum

from .client import Endpoint
from .metrics import SLO
from .workloads import TimeUnit, TokenRange, WorkloadKind

DEFAULT_NUM_REQUESTS = 200


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # None: the first model GET /models lists
    endpoint: Endpoint = Endpoint.COMPLETIONS
    api_key: str | None = None
    # workload
    workload: WorkloadKind = WorkloadKind.RANDOM
    num_requests: int | None = None  # None: DEFAULT_NUM_REQUESTS, or every row of a trace
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    num_prefix_groups: int = 8
    prefix_len: int = 512
    trace: str | None = None
    trace_time_unit: TimeUnit = TimeUnit.MILLISECONDS
    trace_speedup: float = 1.0  # replay the trace's timestamps this many times faster
    block_size: int = 512  # tokens per trace hash id (Mooncake: 512)
    token_ids: TokenRange = TokenRange(16, 4096)
    tokenizer: str | None = None  # send text that re-tokenizes exactly, instead of token ids
    # load
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 600.0
    # outputs
    slo: SLO | None = None
    sweep: tuple[float, ...] | None = None
    result_json: str | None = None
    plot_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base url: expected http(s)://host:port/v1, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num requests: must be >= 1, got {self.num_requests}")
        # Here, by name: the workload's own check said only "length: must be >= 1" (the
        # input's or the output's?), and burstiness was checked once the server had been
        # asked for its models.
        for name, length in (("input len", self.input_len), ("output len", self.output_len)):
            if length < 1:
                raise ValueError(f"{name}: must be >= 1, got {length}")
        if not self.burstiness > 0:  # (NaN too)
            raise ValueError(f"burstiness: must be > 0 (or inf), got {self.burstiness}")
        if self.workload is WorkloadKind.TRACE and not self.trace:
            raise ValueError("trace workload: give --trace PATH")
        if self.endpoint is Endpoint.CHAT and not self.tokenizer:
            raise ValueError("chat endpoint: messages are text, give --tokenizer PATH to build exact-length text")
        if self.sweep is not None and self.slo is None:
            raise ValueError("sweep: give --goodput SLOs, the attainment curve is measured against them")
        if not self.trace_speedup > 0:
            raise ValueError(f"trace speedup: must be > 0, got {self.trace_speedup}")
        if not self.request_timeout > 0:
            raise ValueError(f"request timeout: must be > 0, got {self.request_timeout}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency: must be >= 1, got {self.max_concurrency}")

    def as_json(self) -> dict[str, object]:
        """Every field by name, as JSON writes it (the result file's `config`)."""
        out: dict[str, object] = {}
        for f in fields(self):
            v: object = getattr(self, f.name)
            if isinstance(v, Enum):
                v = v.value
            elif f.name == "slo":  # ms, as given on the command line
                out["slo_ms"] = None if self.slo is None else {k: s * 1000 for k, s in self.slo.as_dict().items()}
                continue
            elif isinstance(v, TokenRange):
                v = [v.lo, v.hi]
            elif isinstance(v, float) and math.isinf(v):
                v = "inf"
            out[f.name] = v
        if self.api_key is not None:
            out["api_key"] = "(set, not recorded)"
        return out
