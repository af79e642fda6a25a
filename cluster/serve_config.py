"""What `pdserve serve` and a Serve YAML configure, and the one mapping to it.

Settings are flat names, the same for a command-line flag (`--max-model-len`
is `max_model_len`) and for the YAML `args:`: `serve_config(settings)` turns
them into a `ServeConfig`, which holds the workers' typed `EngineConfig`.
Every check happens here, on the machine that starts the cluster, with a
`ValueError` that starts with the setting's name: a typo or a bad value fails
before any worker is started on a remote node.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.background_priority import DEFAULT_NICE
from pdserve.cluster.cpu_pinning import CpuPinning
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.placement import CpuSharing, check_kv_host, check_resources
from pdserve.cluster.router.policy import RoutingPolicy
from pdserve.workers.config import EngineConfig, enum_member
from pdserve.workers.decode_worker import KVFailurePolicy
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import Transport


class ServingMode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"  # prefill and decode pools
    COLOCATED = "colocated"  # every worker prefills and decodes: the baseline


class Ingress(str, enum.Enum):
    HAPROXY = "haproxy"  # Ray Serve's HAProxy ingress: HTTP straight to the gateway replica
    PROXY = "proxy"  # Serve's Python proxy actor


# Setting name -> ServeConfig field, for the settings that are not the engine's.
SERVE_SETTINGS = {
    "mode": "mode", "prefill": "num_prefill", "decode": "num_decode", "workers": "num_colocated",
    "host": "host", "port": "port",
    "haproxy_metrics_port": "haproxy_metrics_port", "haproxy_stats_port": "haproxy_stats_port",
    "haproxy_fallback_port": "haproxy_fallback_port",
    "api_key": "api_key", "max_in_flight": "max_in_flight", "transport": "transport", "ingress": "ingress",
    "router_policy": "router_policy", "kv_host": "kv_host", "kv_failure_policy": "kv_failure_policy",
    "prefill_resources": "prefill_resources", "decode_resources": "decode_resources",
    "worker_resources": "worker_resources", "gateway_resources": "gateway_resources",
    "request_timeout": "request_timeout", "prefill_timeout": "prefill_timeout",
    "transfer_timeout": "transfer_timeout", "max_migrations": "max_migrations", "max_restarts": "max_restarts",
    "worker_wait": "worker_wait", "load_poll_interval": "load_poll_interval", "served_model_name": "served_model_name",
    "max_prefill_backlog_tokens": "max_prefill_backlog_tokens",
    "metrics_api_key": "metrics_api_key",
    "planner_profile": "planner_profile", "slo": "slo", "planner_interval": "planner_interval",
    "autoscale_roles": "autoscale_roles", "cpu_sharing": "cpu_sharing", "cpu_pinning": "cpu_pinning",
    "control_plane_nice": "control_plane_nice",
    # What one request may ask for (cluster/limits.py): the same names as RequestLimits'.
    **{f.name: f.name for f in dataclasses.fields(RequestLimits)},
}
ENGINE_SETTINGS = EngineConfig.settings()
_ENUMS: dict[str, type[enum.Enum]] = {
    "mode": ServingMode, "transport": Transport, "ingress": Ingress, "router_policy": RoutingPolicy,
    "kv_failure_policy": KVFailurePolicy, "cpu_sharing": CpuSharing, "cpu_pinning": CpuPinning}


# The default prefill backlog past which a CPU cluster's decode worker prefills (ServeConfig).
CPU_PREFILL_BACKLOG_TOKENS = 1024


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig  # every worker's (a prefill worker drops speculation: it never decodes)
    mode: ServingMode = ServingMode.DISAGGREGATED
    num_prefill: int = 1  # disaggregated only
    num_decode: int = 1
    # Colocated only: how many workers, each prefilling and decoding. None: what fits
    # the cluster, decided when it starts (`fit_to_cluster`): one per GPU, else one
    # worker on the CPU's cores (two workers on one CPU would split its cores); a small
    # model's leaves one of them to the serving plane (cluster/placement.py).
    num_colocated: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # The HAProxy ingress's own ports, and that of Serve's Python proxy it falls
    # back to (Ray Serve's defaults); local Ray only: a running cluster keeps the
    # ports it was started with.
    haproxy_metrics_port: int = 9101
    haproxy_stats_port: int = 8404
    haproxy_fallback_port: int = 8500
    # Never in a repr (a config may be logged): `pdserve serve` reads them from a file
    # or the environment (PDSERVE_API_KEY, PDSERVE_METRICS_API_KEY), not from argv.
    api_key: str | None = field(default=None, repr=False)
    # The key GET /metrics wants (besides the API key); None: /metrics is open.
    metrics_api_key: str | None = field(default=None, repr=False)
    max_in_flight: int = 256
    transport: Transport = Transport.ZMQ
    # How CPU workers share a node's cores (cluster/placement.py): split, turns or lend.
    cpu_sharing: CpuSharing = CpuSharing.AUTO
    # Workers that decode (decode or colocated) with a fixed share of a CPU node's cores on
    # cores of their own, the serving plane and prefill workers on the others
    # (cluster/cpu_pinning.py); local Ray only.
    cpu_pinning: CpuPinning = CpuPinning.AUTO
    # The nice value local Ray's and Serve's own processes run at, behind the engines
    # (cluster/background_priority.py); 0 leaves them as they start. A cluster joined
    # with RAY_ADDRESS is left alone.
    control_plane_nice: int = DEFAULT_NICE
    ingress: Ingress = Ingress.HAPROXY
    router_policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    # The address every data-plane socket binds and advertises (decode workers' KV
    # receivers, the gateway's token stream), resolved on each node (cluster/placement.py):
    # None: the node's Ray address when Ray has several nodes, else 127.0.0.1; "auto":
    # the node's Ray address; or an IPv4 address. Keep it on a private network.
    kv_host: str | None = None
    kv_failure_policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE
    # Ray custom resources each actor of a pool requires, to put the pool on the nodes
    # that offer them (cluster/placement.py); None: any node. Worker: colocated workers.
    prefill_resources: dict[str, float] | None = field(default=None, hash=False)
    decode_resources: dict[str, float] | None = field(default=None, hash=False)
    worker_resources: dict[str, float] | None = field(default=None, hash=False)
    gateway_resources: dict[str, float] | None = field(default=None, hash=False)
    request_timeout: float = 600.0  # seconds a request may take, from its arrival at the gateway
    # Seconds a decode worker gives a remote prefill and its KV transfer (the
    # request's first token) before the failure policy applies (None: the
    # request's whole deadline).
    prefill_timeout: float | None = 120.0
    # Seconds a prefill worker waits on one KV link (a credit, the receiver's
    # verdict) before it gives the transfer up: a hung or dead decode worker
    # costs its transfers this long at most (a dead one's link breaks sooner).
    transfer_timeout: float = 30.0
    # Times a request moves to another worker after its worker died, before it
    # fails with one clean error.
    max_migrations: int = 2
    # Seconds a request under way waits for a worker when none can take it (its
    # worker died and the pool's others are down too, or it was the only one:
    # Ray restarts it in seconds) before it fails with one clean error. 0: no wait.
    worker_wait: float = 10.0
    # Seconds between the gateway's polls of each disaggregated worker's load and KV events.
    # Each poll is a Ray call on both sides and a hop onto the worker's engine thread: at
    # 0.05 s they cost the tiny model ~10% of its served throughput on two cores
    # (docs/cluster.md). Between polls the router charges what it routes to the worker.
    load_poll_interval: float = 0.25
    # Conditional disaggregation (cluster/router/policy.py RouterConfig): a decode worker
    # prefills a prompt itself when the prefill worker the router picked has this many prompt
    # tokens queued and it has fewer. 0: every prompt goes to a prefill worker. None: 1024 on
    # a CPU cluster (on 2 cores it took 1P+1D from 1578, 1481 to 1851, 2012 tok/s and halved
    # TTFT; docs/performance.md), off on GPUs, where a decode step is what disaggregation
    # protects and the rule is not measured.
    max_prefill_backlog_tokens: int | None = None
    # Times Ray restarts a crashed worker (-1: always; 0: never).
    max_restarts: int = -1
    # The names the API answers to (vLLM's --served-model-name): responses carry the
    # first. None: the model setting as given, and its basename (`served_names`).
    served_model_name: tuple[str, ...] | None = None
    # Bounds on one request (cluster/limits.py has what each defends).
    max_n: int = RequestLimits.max_n
    max_prompts: int = RequestLimits.max_prompts
    max_stop: int = RequestLimits.max_stop
    max_stop_length: int = RequestLimits.max_stop_length
    max_messages: int = RequestLimits.max_messages
    max_logit_bias: int = RequestLimits.max_logit_bias
    max_cache_salt_length: int = RequestLimits.max_cache_salt_length
    max_body_bytes: int = RequestLimits.max_body_bytes
    body_timeout: float = RequestLimits.body_timeout
    write_timeout: float = RequestLimits.write_timeout
    # The planner loop in the gateway (cluster/planner/role_loop.py): a profile from
    # `pdserve profile` and the SLOs ("ttft:MS", "tpot:MS"); every `planner_interval`
    # seconds it re-plans the split on the window's traffic and recommends (a metric, a
    # log line), or with `autoscale_roles` moves a worker. Disaggregated mode only.
    planner_profile: str | None = None
    slo: tuple[str, ...] | None = None
    planner_interval: float = 60.0
    autoscale_roles: bool = False
    # Made from the four above (the profile read on the machine that starts the cluster).
    planner: Any = field(default=None, repr=False, compare=False, hash=False)
    # The data plane's key (workers/transfer/auth.py): PDSERVE_CLUSTER_SECRET, else made
    # here, once per cluster start; handed to every worker and the gateway; never shown.
    cluster_secret: ClusterSecret = field(default_factory=ClusterSecret.from_env_or_new, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.limits  # noqa: B018 - RequestLimits checks its own (a ValueError naming the setting)
        for name in ("api_key", "metrics_api_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, str) or not key.strip()):
                raise ValueError(f"{name}: must be a non-empty string")
        for name, kind in _ENUMS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                object.__setattr__(self, name, enum_member(name, kind, value))
        for setting, name, least in (("prefill", "num_prefill", 1), ("decode", "num_decode", 1),
                                     ("max_in_flight", "max_in_flight", 1), ("port", "port", 1),
                                     ("max_migrations", "max_migrations", 0), ("max_restarts", "max_restarts", -1),
                                     ("control_plane_nice", "control_plane_nice", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"{setting}: must be an integer >= {least}, got {value!r}")
        if self.num_colocated is not None:
            if type(self.num_colocated) is not int or self.num_colocated < 1:
                raise ValueError(f"workers: must be an integer >= 1, got {self.num_colocated!r}")
            if self.mode is not ServingMode.COLOCATED:
                raise ValueError("workers: colocated mode only; a disaggregated cluster takes prefill and decode")
        if self.served_model_name is not None:
            names: Any = self.served_model_name  # YAML and callers may give one name, or a list
            if isinstance(names, str):
                names = (names,)
            if not isinstance(names, (list, tuple)) or not names or \
                    not all(isinstance(n, str) and n.strip() for n in names):
                raise ValueError(f"served_model_name: must be one or more non-empty names, got {names!r}")
            object.__setattr__(self, "served_model_name", tuple(dict.fromkeys(names)))
        if isinstance(self.worker_wait, bool) or not isinstance(self.worker_wait, (int, float)) \
                or not 0 <= self.worker_wait < math.inf:
            raise ValueError(f"worker_wait: must be a number of seconds >= 0, got {self.worker_wait!r}")
        backlog = self.max_prefill_backlog_tokens
        if backlog is not None and (isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 0):
            raise ValueError("max_prefill_backlog_tokens: must be an int >= 0 (0: off), got "
                             f"{self.max_prefill_backlog_tokens!r}")
        if isinstance(self.load_poll_interval, bool) or not isinstance(self.load_poll_interval, (int, float)) \
                or not 0 < self.load_poll_interval <= 60:
            raise ValueError(f"load_poll_interval: must be seconds in (0, 60], got {self.load_poll_interval!r}")
        if self.control_plane_nice > 19:
            raise ValueError(f"control_plane_nice: must be in 0..19, got {self.control_plane_nice}")
        if self.port > 65535:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        for name in ("request_timeout", "prefill_timeout", "transfer_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: must be a non-empty string, got {self.host!r}")
        object.__setattr__(self, "kv_host", check_kv_host(self.kv_host))
        object.__setattr__(self, "planner", self._planner_settings())
        self._check_pool_resources()
        for name in ("haproxy_metrics_port", "haproxy_stats_port", "haproxy_fallback_port"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= 65535:
                raise ValueError(f"{name}: must be an integer in 1..65535, got {value!r}")
        if self.ingress is Ingress.HAPROXY:
            ports = {"port": self.port, "haproxy_metrics_port": self.haproxy_metrics_port,
                     "haproxy_stats_port": self.haproxy_stats_port, "haproxy_fallback_port": self.haproxy_fallback_port}
            named = list(ports.items())
            for i, (name, value) in enumerate(named):
                clash = [other for other, v in named[:i] if v == value]
                if clash:
                    raise ValueError(f"{name}: {value} is also {clash[0]}; every port must differ")

    def _planner_settings(self) -> Any:
        """PlannerSettings, or None when no planner is asked for. ValueError naming the setting."""
        if not isinstance(self.autoscale_roles, bool):  # YAML may give a string
            raise ValueError(f"autoscale_roles: must be true or false, got {self.autoscale_roles!r}")
        if self.planner_profile is None:
            if self.autoscale_roles or self.slo is not None:
                raise ValueError("planner_profile: the planner needs a profile (pdserve profile --out FILE) for "
                                 f"{'autoscale_roles' if self.autoscale_roles else 'slo'}")
            return None
        if self.mode is not ServingMode.DISAGGREGATED:
            raise ValueError("planner_profile: the planner sizes prefill and decode pools: disaggregated mode only")
        if not self.slo:
            raise ValueError("slo: the planner needs SLOs, e.g. ttft:500 tpot:50 (milliseconds)")
        given: Any = self.slo  # YAML may give one string
        slo_items = (given,) if isinstance(given, str) else tuple(given)
        object.__setattr__(self, "slo", slo_items)
        if isinstance(self.planner_interval, bool) or not isinstance(self.planner_interval, (int, float)) \
                or not 0 < self.planner_interval < math.inf:
            raise ValueError(f"planner_interval: must be a number of seconds > 0, got {self.planner_interval!r}")
        from pdserve.cluster.bench.metrics import SLO
        from pdserve.cluster.planner.profile import Profile
        from pdserve.cluster.planner.role_loop import PlannerSettings

        try:
            slo = SLO.parse(list(slo_items))
        except ValueError as e:
            raise ValueError(f"slo: {e}") from None
        try:
            profile = Profile.load(self.planner_profile)
        except (OSError, ValueError) as e:
            raise ValueError(f"planner_profile: {e}") from None
        served = self._served_dtype(profile.engine.device)
        if served is not None and served != profile.engine.dtype:
            raise ValueError(f"planner_profile: its steps were timed in {profile.engine.dtype}, but the workers would "
                             f"compute in {served}, which changes every step's time: serve with --dtype "
                             f"{profile.engine.dtype}, or profile with --dtype {served}")
        return PlannerSettings(profile, slo, interval_s=float(self.planner_interval), apply=self.autoscale_roles)

    def _served_dtype(self, profile_device: str) -> str | None:
        """The dtype the workers will compute in, where it can be told here: given, or `auto` on a
        CPU like the one the profile was taken on (this node's flags stand for the workers'). None
        for `auto` on a GPU (the checkpoint decides, on the worker)."""
        from pdserve.workers.config import DType

        if self.engine.dtype is not DType.AUTO:
            return str(self.engine.dtype.value)
        if profile_device != "cpu" or self.engine.device not in ("cpu", "auto"):
            return None
        from pdserve.workers.cpu_features import has_native_bf16

        return "bfloat16" if has_native_bf16() else "float32"

    def _check_pool_resources(self) -> None:
        pools = {"prefill_resources": ServingMode.DISAGGREGATED, "decode_resources": ServingMode.DISAGGREGATED,
                 "worker_resources": ServingMode.COLOCATED, "gateway_resources": None}
        for name, mode in pools.items():
            object.__setattr__(self, name, check_resources(name, getattr(self, name)))
            if getattr(self, name) is not None and mode is not None and self.mode is not mode:
                raise ValueError(f"{name}: {mode.value} mode only (this config is {self.mode.value})")

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RequestLimits)})

    @property
    def served_names(self) -> tuple[str, ...]:
        """The API's model names, the one responses report first."""
        return self.served_model_name or default_served_names(self.model)

    @property
    def num_workers(self) -> int:
        if self.mode is ServingMode.DISAGGREGATED:
            return self.num_prefill + self.num_decode
        if self.num_colocated is None:
            raise ValueError("workers: not decided yet (fit_to_cluster decides it once Ray is up)")
        return self.num_colocated

    def worker_names(self) -> list[str]:
        if self.mode is ServingMode.DISAGGREGATED:
            return self.prefill_names() + self.decode_names()
        return [f"pdserve-worker-{i}" for i in range(self.num_workers)]

    def prefill_backlog_tokens(self, gpus: float) -> int:
        """`max_prefill_backlog_tokens` on a cluster with `gpus` GPUs (None: the default there)."""
        if self.max_prefill_backlog_tokens is not None:
            return self.max_prefill_backlog_tokens
        return 0 if gpus else CPU_PREFILL_BACKLOG_TOKENS

    def fit_to_cluster(self, cluster_gpus: Callable[[], float]) -> ServeConfig:
        """This config with the colocated worker count decided, where it was left to the
        cluster: one worker per GPU (`cluster_gpus()`, asked only then), or one on a CPU-only cluster."""
        if self.mode is not ServingMode.COLOCATED or self.num_colocated is not None:
            return self
        return dataclasses.replace(self, num_colocated=max(1, int(cluster_gpus())))

    def prefill_names(self) -> list[str]:
        return [f"pdserve-prefill-{i}" for i in range(self.num_prefill)]

    def decode_names(self) -> list[str]:
        return [f"pdserve-decode-{i}" for i in range(self.num_decode)]


def default_served_names(model: str) -> tuple[str, ...]:
    """vLLM reports the model argument as given (a path, a hub id); pdserve also
    answers to its basename, the name the directory is known by."""
    base = os.path.basename(model.rstrip("/")) or model
    return (model,) if base == model else (model, base)


def serve_config(settings: Mapping[str, Any]) -> ServeConfig:
    """The ServeConfig `settings` describe (flat names: see the module docstring)."""
    _check_names(settings, ENGINE_SETTINGS | SERVE_SETTINGS.keys())
    if str(settings.get("mode", "")) in (ServingMode.COLOCATED, ServingMode.COLOCATED.value):
        for name in ("prefill", "decode"):
            if name in settings:
                raise ValueError(f"{name}: disaggregated mode only; a colocated cluster takes workers "
                                 "(--workers N; default: one per GPU, else one)")
    serve = {field: settings[name] for name, field in SERVE_SETTINGS.items() if name in settings}
    return ServeConfig(engine_config(settings, known=ENGINE_SETTINGS | SERVE_SETTINGS.keys()), **serve)


def engine_config(settings: Mapping[str, Any], progress: bool = False,
                  known: frozenset[str] | set[str] = ENGINE_SETTINGS) -> EngineConfig:
    """The EngineConfig the engine settings among `settings` describe (`pdserve generate`)."""
    _check_names(settings, known)
    if settings.get("model") is None:
        raise ValueError("model: required (an HF-format model directory)")
    return EngineConfig(**{k: v for k, v in settings.items() if k in ENGINE_SETTINGS}, progress=progress)


def with_engine(cfg: ServeConfig, **changes: Any) -> ServeConfig:
    """`cfg` with some engine settings changed."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **changes))


def _check_names(settings: Mapping[str, Any], known: frozenset[str] | set[str]) -> None:
    for name in settings:
        if name not in known:
            raise ValueError(f"{name}: unknown setting (known: {', '.join(sorted(known))})")

