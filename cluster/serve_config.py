"""What `pdserve serve` and a Serve YAML configure, and the one mapping to it.

Settings are flat names, the same for a command-line flag (`--max-model-len`
is `max_model_len`) and for the YAML `args:`: `serve_config(settings)` turns
them into a `ServeConfig`, which holds the workers' typed `EngineConfig`.
Every check happens here, on the machine that starts the cluster, with a
`ValueError` that starts with the setting's name: a typo or a bad value fails
before any worker is started on a remote node. Both configs are pydantic
dataclasses (workers/config.py says how they check): a field's bounds are its
annotation; what spans fields is `ServeConfig._check_together`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass

from pdserve.cluster.background_priority import DEFAULT_NICE
from pdserve.cluster.chat_template import load_chat_template
from pdserve.cluster.cors import CorsSettings, string_list
from pdserve.cluster.cpu_pinning import CpuPinning
from pdserve.cluster.limits import RequestLimits
from pdserve.cluster.placement import CpuSharing, check_host, check_kv_host, check_resources
from pdserve.cluster.reasoning import ReasoningParser
from pdserve.cluster.router.policy import RoutingPolicy
from pdserve.cluster.stall_watch import DEFAULT_STALL_TIMEOUT_S
from pdserve.cluster.tool_calls import ToolParser
from pdserve.workers import generation_defaults
from pdserve.workers.config import CONFIG, ByValue, EngineConfig, NotBlank, Seconds, named_errors
from pdserve.workers.handoff import KVFailurePolicy
from pdserve.workers.inputs import check_template_kwargs, json_object
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import Transport

# Settings only the disaggregated pools read (their KV handoff, router and polls). A colocated
# worker is watched by its own polls (cluster/colocated_watch.py: every stall_timeout / 10).
_DISAGGREGATED_ONLY = ("router_policy", "kv_failure_policy", "transport", "prefill_timeout", "transfer_timeout",
                       "max_prefill_backlog_tokens", "load_poll_interval")


class ServingMode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"  # prefill and decode pools
    COLOCATED = "colocated"  # every worker prefills and decodes: the baseline


class Ingress(str, enum.Enum):
    HAPROXY = "haproxy"  # Ray Serve's HAProxy ingress: HTTP straight to the gateway replica
    PROXY = "proxy"  # Serve's Python proxy actor


# The default prefill backlog past which a CPU cluster's decode worker prefills (ServeConfig).
CPU_PREFILL_BACKLOG_TOKENS = 1024

# GPU workers per gateway replica when the count is left to the cluster. One replica carries
# ~20k streamed tokens a second at the issue-47 bar (50 us of CPU a token); one H200 decodes
# the Llama-3-8B shape at ~9k tok/s at batch 64 (docs/gpu.md): a replica per ~2-4 GPUs, 4 while
# most of a GPU's tokens go to long outputs that stream well under its peak.
GPUS_PER_GATEWAY = 4

# The ServeConfig fields whose setting (flag, YAML arg) has another name: `--prefill N`.
_SETTING_NAMES = {"num_prefill": "prefill", "num_decode": "decode", "num_colocated": "workers"}


def _one_or_more(value: Any) -> Any:
    """A list, or one string, as a tuple: flags (nargs="+") and YAML give lists, or YAML one string."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


Port = Annotated[int, Field(ge=1, le=65535)]


def _template_kwargs(value: Any) -> dict[str, object]:
    """A JSON object (the flag's text) or a mapping (YAML), checked as a request's would be."""
    return check_template_kwargs(json_object(value, "default_chat_template_kwargs"), "default_chat_template_kwargs")


TemplateKwargs = Annotated[dict[str, Any], BeforeValidator(_template_kwargs)]
GenerationOverrides = Annotated[dict[str, float], BeforeValidator(generation_defaults.overrides)]
# A list of strings: from YAML, a JSON list (vLLM's flag form) or one string (cluster/cors.py).
StringList = Annotated[tuple[str, ...], BeforeValidator(lambda v, info: string_list(str(info.field_name), v))]
# The API's model names: one or more, repeats dropped (order kept).
Names = Annotated[tuple[NotBlank, ...], BeforeValidator(_one_or_more), Field(min_length=1),
                  AfterValidator(lambda names: tuple(dict.fromkeys(names)))]


@named_errors(_SETTING_NAMES)
@dataclass(frozen=True, config=CONFIG)
class ServeConfig:
    engine: EngineConfig  # every worker's (a prefill worker drops speculation: it never decodes)
    mode: Annotated[ServingMode, ByValue] = ServingMode.DISAGGREGATED
    num_prefill: PositiveInt = 1  # disaggregated only
    num_decode: PositiveInt = 1
    # Colocated only: how many workers, each prefilling and decoding. None: what fits
    # the cluster, decided when it starts (`fit_to_cluster`): one per GPU, else one
    # worker on the CPU's cores (two workers on one CPU would split its cores); a small
    # model's leaves one of them to the serving plane (cluster/placement.py).
    num_colocated: PositiveInt | None = None
    host: Annotated[str, BeforeValidator(check_host)] = "127.0.0.1"
    port: Port = 8000
    # The HAProxy ingress's own ports, and that of Serve's Python proxy it falls
    # back to (Ray Serve's defaults); local Ray only: a running cluster keeps the
    # ports it was started with.
    haproxy_metrics_port: Port = 9101
    haproxy_stats_port: Port = 8404
    haproxy_fallback_port: Port = 8500
    # Which of those the operator left to pdserve (named by no flag or setting): one that another
    # live process holds at the start moves to a free port (serve_app.settle_haproxy_ports), so a
    # second run on another --port starts as it would in vLLM. A port named never moves.
    haproxy_ports_auto: frozenset[str] = frozenset()
    # The HAProxy ingress's defences (cluster/ingress.py, local Ray only): connections at
    # once from one client address, and in all; seconds a client has for a request's
    # headers (and the start of its body), and an idle connection between requests.
    max_connections_per_client: PositiveInt = 256
    max_connections: PositiveInt = 8192
    header_timeout: Seconds = 10.0
    keep_alive_timeout: Seconds = 15.0
    # Never in a repr (a config may be logged): `pdserve serve` reads them from a file
    # or the environment (PDSERVE_API_KEY, PDSERVE_METRICS_API_KEY), not from argv.
    api_key: NotBlank | None = field(default=None, repr=False)
    # The key GET /metrics wants (besides the API key); None: /metrics is open.
    metrics_api_key: NotBlank | None = field(default=None, repr=False)
    # Engine requests admitted at once by the whole gateway tier: each replica admits its
    # share (`admission_share`), so N replicas bound it as one did.
    max_in_flight: PositiveInt = 256
    # Gateway replicas, each a whole gateway (HAProxy spreads connections over them: leastconn).
    # None: decided when the cluster starts (`fit_to_cluster`): one per GPUS_PER_GATEWAY GPU
    # workers on a GPU cluster, where one replica carries fewer tokens than a few GPUs make;
    # one on a CPU-only cluster, whose engines make fewer tokens than one replica carries.
    gateway_replicas: PositiveInt | None = None
    transport: Annotated[Transport, ByValue] = Transport.ZMQ
    # How CPU workers share a node's cores (cluster/placement.py): split, turns or lend.
    cpu_sharing: Annotated[CpuSharing, ByValue] = CpuSharing.AUTO
    # Workers that decode (decode or colocated) with a fixed share of a CPU node's cores on
    # cores of their own, the serving plane and prefill workers on the others
    # (cluster/cpu_pinning.py); local Ray only.
    cpu_pinning: Annotated[CpuPinning, ByValue] = CpuPinning.AUTO
    # The nice value local Ray's and Serve's own processes run at, behind the engines
    # (cluster/background_priority.py); 0 leaves them as they start. A cluster joined
    # with RAY_ADDRESS is left alone.
    control_plane_nice: Annotated[int, Field(ge=0, le=19)] = DEFAULT_NICE
    ingress: Annotated[Ingress, ByValue] = Ingress.HAPROXY
    router_policy: Annotated[RoutingPolicy, ByValue] = RoutingPolicy.CACHE_AWARE
    # The address every data-plane socket binds and advertises (decode workers' KV
    # receivers, the gateway's token stream), resolved on each node (cluster/placement.py):
    # None: the node's Ray address when Ray has several nodes, else 127.0.0.1; "auto":
    # the node's Ray address; or an IPv4 address. Keep it on a private network.
    kv_host: Annotated[str | None, BeforeValidator(check_kv_host)] = None
    kv_failure_policy: Annotated[KVFailurePolicy, ByValue] = KVFailurePolicy.RECOMPUTE
    # Tensor-parallel ranks of each prefill / decode worker (vLLM's --tensor-parallel-size per
    # pool, SGLang's per-pool --tp); None: the engine's tensor_parallel_size. Disaggregated only.
    # KV crosses between sizes re-sharded by head (workers/kv/shared_cache.py). CPU only so far.
    prefill_tp: PositiveInt | None = None
    decode_tp: PositiveInt | None = None
    # Ray custom resources each actor of a pool requires, to put the pool on the nodes
    # that offer them (cluster/placement.py); None: any node. Worker: colocated workers.
    prefill_resources: dict[str, float] | None = field(default=None, hash=False)
    decode_resources: dict[str, float] | None = field(default=None, hash=False)
    worker_resources: dict[str, float] | None = field(default=None, hash=False)
    gateway_resources: dict[str, float] | None = field(default=None, hash=False)
    request_timeout: Seconds = 600.0  # seconds a request may take, from its arrival at the gateway
    # Seconds a decode worker gives a remote prefill and its KV transfer (the
    # request's first token) before the failure policy applies (None: the
    # request's whole deadline).
    prefill_timeout: Seconds | None = 120.0
    # Seconds a prefill worker waits on one KV link (a credit, the receiver's
    # verdict) before it gives the transfer up: a hung or dead decode worker
    # costs its transfers this long at most (a dead one's link breaks sooner).
    transfer_timeout: Seconds = 30.0
    # Times a request moves to another worker after its worker died, before it
    # fails with one clean error.
    max_migrations: NonNegativeInt = 2
    # Output tokens a streamed chunk gathers after the first (vLLM's and SGLang's --stream-interval):
    # fewer chunks cost the gateway less CPU a token (docs/performance.md), at the price of
    # burstier streams. 1: every token as it comes (a reader that is behind gets what queued).
    stream_interval: PositiveInt = 1
    # Where a request's unset sampling fields come from (vLLM's --generation-config): "auto", the
    # model's generation_config.json, else vLLM's defaults; "vllm", vLLM's defaults only.
    generation_config: Literal["auto", "vllm"] = "auto"
    # With tool_choice "none" the chat template still shows the model its tools (OpenAI's, and
    # vLLM's default); True leaves them out (vLLM's --exclude-tools-when-tool-choice-none).
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's --enable-log-requests / --enable-log-outputs / --max-log-len: the gateway logs a line per
    # request it starts and per answer it ends, prompts and outputs cut to max_log_len characters and
    # token ids (cluster/request_log.py). Off by default: prompts are users' data.
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: NonNegativeInt | None = None
    # vLLM's --enable-force-include-usage: every streamed response ends with a usage chunk, whether
    # its stream_options asked for one or not (a billing proxy's need).
    enable_force_include_usage: bool = False
    # vLLM's --disable-fastapi-docs: no /docs, /redoc or /openapi.json on the gateway.
    disable_fastapi_docs: bool = False
    # vLLM's --uvicorn-log-level: the gateway replicas' log level (Ray Serve's logger, access log
    # included, which logs at INFO). None: Serve's default, INFO.
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = None
    # vLLM's --disable-uvicorn-access-log: the gateway replicas log no line per HTTP request (Ray
    # Serve's access log, on by default, as uvicorn's is in vLLM).
    disable_uvicorn_access_log: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens `token_id:<id>` (a request's own
    # return_tokens_as_token_ids wins), so that a token that is not valid UTF-8 alone is told apart.
    return_tokens_as_token_ids: bool = False
    # vLLM's --chat-template: a file with a Jinja chat template, or the template itself, used in
    # place of the tokenizer's own (cluster/chat_template.py). Held as the template's text.
    chat_template: str | None = None
    # vLLM's --reasoning-parser: a thinking model's chat answers carry their thinking (between
    # <think> and </think>) in `reasoning`, apart from the content (cluster/reasoning.py). None: not split.
    reasoning_parser: ReasoningParser | None = None
    # vLLM's --tool-call-parser: the one format "auto" tool calls are parsed for (hermes: Hermes,
    # Qwen2.5, Qwen3; mistral; llama3_json). None: each of them (cluster/tool_calls.py).
    tool_call_parser: ToolParser | None = None
    # vLLM's --override-generation-config: generation_config.json keys over the model's own (with
    # generation_config "vllm", the only defaults), e.g. {"temperature": 0.5}; a request's own win.
    override_generation_config: GenerationOverrides = field(default_factory=dict)
    # vLLM's --default-chat-template-kwargs: chat_template_kwargs every chat request starts from
    # (its own win, key by key), e.g. {"enable_thinking": false} to serve a Qwen3 without thinking.
    default_chat_template_kwargs: TemplateKwargs = field(default_factory=dict)
    # Browsers' cross-origin requests (cluster/cors.py; vLLM's flags of these names): the origins
    # allowed ("*": any; none by default, where vLLM allows any), and what they may send.
    allowed_origins: StringList = ()
    allowed_methods: StringList = ("*",)
    allowed_headers: StringList = ("*",)
    allow_credentials: bool = False
    # Seconds a request under way waits for a worker when none can take it (its
    # worker died and the pool's others are down too, or it was the only one:
    # Ray restarts it in seconds) before it fails with one clean error. 0: no wait.
    worker_wait: Annotated[float, Field(ge=0)] = 10.0
    # Seconds between the gateway's polls of each disaggregated worker's load and KV events.
    # Each poll is a Ray call on both sides and a hop onto the worker's engine thread: at
    # 0.05 s they cost the tiny model ~10% of its served throughput on two cores
    # (docs/cluster.md). Between polls the router charges what it routes to the worker.
    load_poll_interval: Annotated[float, Field(gt=0, le=60)] = 0.25
    # Seconds a worker may hold work without progress (no answer to the polls, or no
    # token computed) before the gateway takes it for dead: its requests move on and Ray
    # restarts it (cluster/stall_watch.py; a colocated worker is polled ten times per
    # timeout for it: cluster/colocated_watch.py). A few times the slowest step expected;
    # 0: never.
    stall_timeout: Annotated[float, Field(ge=0)] = DEFAULT_STALL_TIMEOUT_S
    # Conditional disaggregation (cluster/router/policy.py RouterConfig): a decode worker
    # prefills a prompt itself when the prefill worker the router picked has this many prompt
    # tokens queued and it has fewer. 0: every prompt goes to a prefill worker. None: 1024 on
    # a CPU cluster (on 2 cores it took 1P+1D from 1578, 1481 to 1851, 2012 tok/s and halved
    # TTFT; docs/performance.md), off on GPUs, where a decode step is what disaggregation
    # protects and the rule is not measured.
    max_prefill_backlog_tokens: NonNegativeInt | None = None
    # Times Ray restarts a crashed worker (-1: always; 0: never).
    max_restarts: Annotated[int, Field(ge=-1)] = -1
    # Seconds `pdserve serve` waits for its workers to build their engines (load, and compile,
    # the model) before the start fails naming those not up. A Serve YAML's builder has its own
    # (`worker_timeout_s`, deploy/pdserve_app.py).
    worker_start_timeout: Seconds = 300.0
    # The names the API answers to (vLLM's --served-model-name): responses carry the
    # first. None: the model setting as given, and its basename (`served_names`).
    served_model_name: Names | None = None
    # Bounds on one request (cluster/limits.py has what each defends).
    max_n: PositiveInt = RequestLimits.max_n
    max_prompts: PositiveInt = RequestLimits.max_prompts
    max_stop: PositiveInt = RequestLimits.max_stop
    max_stop_length: PositiveInt = RequestLimits.max_stop_length
    max_messages: PositiveInt = RequestLimits.max_messages
    max_logit_bias: PositiveInt = RequestLimits.max_logit_bias
    max_cache_salt_length: PositiveInt = RequestLimits.max_cache_salt_length
    max_body_bytes: PositiveInt = RequestLimits.max_body_bytes
    body_timeout: Seconds = RequestLimits.body_timeout
    write_timeout: Seconds = RequestLimits.write_timeout
    # The planner loop in the gateway (cluster/planner/role_loop.py): a profile from
    # `pdserve profile` and the SLOs ("ttft:MS", "tpot:MS"); every `planner_interval`
    # seconds it re-plans the split on the window's traffic and recommends (a metric, a
    # log line), or with `autoscale_roles` moves a worker. Disaggregated mode only.
    planner_profile: str | None = None
    slo: Annotated[tuple[str, ...], BeforeValidator(_one_or_more)] | None = None
    planner_interval: Seconds = 60.0
    autoscale_roles: bool = False
    # The data plane's key (workers/transfer/auth.py): PDSERVE_CLUSTER_SECRET, else made
    # here, once per cluster start; handed to every worker and the gateway; never shown.
    cluster_secret: ClusterSecret = field(default_factory=ClusterSecret.from_env_or_new, repr=False, compare=False)

    @field_validator("prefill_resources", "decode_resources", "worker_resources", "gateway_resources",
                     mode="before")
    @classmethod
    def _resources(cls, value: Any, info: ValidationInfo) -> dict[str, float] | None:
        return check_resources(str(info.field_name), value)

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        return None if value is None else load_chat_template(value)

    @field_validator("api_key", "metrics_api_key")
    @classmethod
    def _sendable_key(cls, key: str | None, info: ValidationInfo) -> str | None:
        # Clients send a key in a header, as printable ASCII (the OpenAI SDK can send nothing
        # else; other bytes reach the guard as Latin-1): any other key would let no one in.
        if key is not None and not (key.isascii() and key.isprintable()):
            raise ValueError(f"{info.field_name}: a key is sent in a header: printable ASCII only "
                             "(the key is not shown)")
        return key

    @model_validator(mode="after")
    def _check_together(self) -> ServeConfig:
        self.limits  # noqa: B018 - RequestLimits checks its own (a ValueError naming the setting)
        self.cors  # noqa: B018 - CorsSettings likewise
        if self.num_colocated is not None and self.mode is not ServingMode.COLOCATED:
            raise ValueError("workers: colocated mode only; a disaggregated cluster takes prefill and decode")
        pools = {"prefill_resources": ServingMode.DISAGGREGATED, "decode_resources": ServingMode.DISAGGREGATED,
                 "worker_resources": ServingMode.COLOCATED}
        for name, mode in pools.items():
            if getattr(self, name) is not None and self.mode is not mode:
                raise ValueError(f"{name}: {mode.value} mode only (this config is {self.mode.value})")
        for name in ("prefill_tp", "decode_tp"):
            if getattr(self, name) is not None and self.mode is not ServingMode.DISAGGREGATED:
                raise ValueError(f"{name}: disaggregated mode only; a colocated worker takes tensor_parallel_size")
        if self.engine.device.startswith("cuda:") and self.engine.device != "cuda:0":
            # What cluster/placement.py refuses once Ray is up and workers are placed: refused
            # here, before (the command line's start, the Serve YAML's checks).
            raise ValueError(f"device: {self.engine.device} names one GPU of a machine; under Ray each worker sees "
                             "only the GPU Ray gave it, as cuda (use --device cuda)")
        if max(self.pool_tp(pool) for pool in ("prefill", "decode")) > 1 and self.cpu_sharing in (
                CpuSharing.TURNS, CpuSharing.LEND):
            raise ValueError(f"cpu_sharing: {self.cpu_sharing.value} does not apply to tensor-parallel workers "
                             "(their ranks step on a split share of the cores): use split or auto")
        if self.ingress is Ingress.HAPROXY:
            named = [(name, getattr(self, name)) for name in
                     ("port", "haproxy_metrics_port", "haproxy_stats_port", "haproxy_fallback_port")]
            for i, (name, value) in enumerate(named):
                clash = [other for other, v in named[:i] if v == value]
                if clash:
                    raise ValueError(f"{name}: {value} is also {clash[0]}; every port must differ")
            if self.max_connections_per_client > self.max_connections:
                raise ValueError(f"max_connections_per_client: {self.max_connections_per_client} is over "
                                 f"max_connections ({self.max_connections})")
        if self.mode is ServingMode.COLOCATED:
            # Settings of the disaggregated pools' handoff and routing: a colocated cluster has
            # none of it, and took them without a word (the operator believed them in force).
            for name in _DISAGGREGATED_ONLY:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ValueError(f"{name}: disaggregated mode only (this config is colocated)")
        elif 0 < self.stall_timeout < 4 * self.load_poll_interval:
            # A disaggregated worker is heard from once a poll: polled this seldom, a busy
            # worker would go unheard for the timeout on every cycle, be taken for hung,
            # and be restarted again and again.
            raise ValueError(f"load_poll_interval: {self.load_poll_interval:g} s leaves stall_timeout "
                             f"({self.stall_timeout:g} s) under four polls; poll more often, or raise the "
                             "stall timeout (0 turns the watch off)")
        if self.gateway_replicas is not None and self.gateway_replicas > self.max_in_flight:
            raise ValueError(f"gateway_replicas: {self.gateway_replicas} replicas cannot share max_in_flight "
                             f"{self.max_in_flight} (each admits at least one request)")
        self.planner  # noqa: B018 - made here, where the profile file is (then it travels with the config)
        return self

    @functools.cached_property
    def planner(self) -> Any:
        """PlannerSettings made from the four planner settings, or None when no planner is asked
        for. ValueError naming the setting."""
        if self.planner_profile is None:
            if self.autoscale_roles or self.slo is not None:
                raise ValueError("planner_profile: the planner needs a profile (pdserve profile --out FILE) for "
                                 f"{'autoscale_roles' if self.autoscale_roles else 'slo'}")
            return None
        if self.mode is not ServingMode.DISAGGREGATED:
            raise ValueError("planner_profile: the planner sizes prefill and decode pools: disaggregated mode only")
        if not self.slo:
            raise ValueError("slo: the planner needs SLOs, e.g. ttft:500 tpot:50 (milliseconds)")
        from pdserve.cluster.bench.metrics import SLO
        from pdserve.cluster.planner.profile import Profile
        from pdserve.cluster.planner.role_loop import PlannerSettings

        try:
            slo = SLO.parse(list(self.slo))
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
        return PlannerSettings(profile, slo, interval_s=self.planner_interval, apply=self.autoscale_roles)

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

    @property
    def model(self) -> str:
        return self.engine.model

    @functools.cached_property
    def limits(self) -> RequestLimits:
        return RequestLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RequestLimits)})

    @functools.cached_property
    def cors(self) -> CorsSettings:
        return CorsSettings(self.allowed_origins, self.allowed_methods, self.allowed_headers, self.allow_credentials)

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
        """`max_prefill_backlog_tokens` on a cluster with `gpus` GPUs (None: the default there; CPU
        workers, `device: cpu`, hold none of them and get a CPU cluster's)."""
        if self.max_prefill_backlog_tokens is not None:
            return self.max_prefill_backlog_tokens
        return 0 if gpus and self.engine.device != "cpu" else CPU_PREFILL_BACKLOG_TOKENS

    def fit_to_cluster(self, cluster_gpus: Callable[[], float],
                       node_gpus: Callable[[], Sequence[float]] | None = None) -> ServeConfig:
        """This config with what was left to the cluster decided (`cluster_gpus()` is asked
        only then): colocated workers, one per GPU, or one on a CPU-only cluster; gateway
        replicas, one per GPUS_PER_GATEWAY GPUs the workers hold, or one on a CPU-only cluster.
        CPU workers (`device: cpu`) hold no GPU (cluster/placement.py): they count as on a
        CPU-only cluster. A worker of N tensor-parallel ranks holds N GPUs of one node: one per N
        of each node's GPUs (`node_gpus()`, the live nodes'; without it, of all the cluster's)."""
        if self.engine.device == "cpu":
            cluster_gpus = _no_gpus
        fitted = self
        gpus: float | None = None
        if self.mode is ServingMode.COLOCATED and self.num_colocated is None:
            gpus = cluster_gpus()
            tp = self.pool_tp("worker")
            fits = (sum(int(g) // tp for g in node_gpus()) if node_gpus is not None and gpus and tp > 1
                    else int(gpus) // tp)
            fitted = dataclasses.replace(fitted, num_colocated=max(1, fits))
        if self.gateway_replicas is None:
            gpus = cluster_gpus() if gpus is None else gpus
            held = min(fitted.worker_gpus(), int(gpus))
            replicas = max(1, min(-(-held // GPUS_PER_GATEWAY), fitted.max_in_flight))
            fitted = dataclasses.replace(fitted, gateway_replicas=replicas)
        return fitted

    def admission_share(self, rank: int) -> int:
        """The engine requests gateway replica `rank` admits at once: `max_in_flight` split
        over the replicas (the first take one more each until it is spent), so that the
        tier admits `max_in_flight` in all. HAProxy spreads connections by least connections,
        so each replica sees about its share of the load."""
        n = self.gateway_replicas or 1
        if not 0 <= rank < n:
            raise ValueError(f"rank: a replica of {n} is 0..{n - 1}, got {rank}")
        return self.max_in_flight // n + (rank < self.max_in_flight % n)

    def pool_tp(self, pool: str) -> int:
        """Tensor-parallel ranks of a worker of `pool` ("prefill", "decode" or "worker": colocated)."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(pool)
        return own if own is not None else self.engine.tensor_parallel_size

    def worker_gpus(self) -> int:
        """GPUs the workers hold where each rank holds one (cluster/placement.py `pool_options`)."""
        if self.mode is ServingMode.COLOCATED:
            return self.num_workers * self.pool_tp("worker")
        return self.num_prefill * self.pool_tp("prefill") + self.num_decode * self.pool_tp("decode")

    def prefill_names(self) -> list[str]:
        return [f"pdserve-prefill-{i}" for i in range(self.num_prefill)]

    def decode_names(self) -> list[str]:
        return [f"pdserve-decode-{i}" for i in range(self.num_decode)]


def _no_gpus() -> float:
    return 0.0


# Setting name -> ServeConfig field, for the settings that are not the engine's: every field but
# the engine's config and the data plane's key (a file or the environment, never a setting).
SERVE_SETTINGS = {_SETTING_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(ServeConfig)
                  if f.name not in ("engine", "cluster_secret", "haproxy_ports_auto")}
HAPROXY_PORTS = ("haproxy_metrics_port", "haproxy_stats_port", "haproxy_fallback_port")
ENGINE_SETTINGS = EngineConfig.settings()


def default_served_names(model: str) -> tuple[str, ...]:
    """vLLM reports the model argument as given (a path, a hub id); pdserve also
    answers to its basename, the name the directory is known by."""
    base = os.path.basename(model.rstrip("/")) or model
    return (model,) if base == model else (model, base)


# Engine settings that only speculative decoding reads (`engine_config`).
_SPECULATIVE_ONLY = ("num_speculative_tokens", "spec_ngram_min", "spec_ngram_max", "spec_token_cost",
                     "spec_max_batch_size")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeConfig) if f.name in _DISAGGREGATED_ONLY}


def serve_config(settings: Mapping[str, Any]) -> ServeConfig:
    """The ServeConfig `settings` describe (flat names: see the module docstring)."""
    _check_names(settings, ENGINE_SETTINGS | SERVE_SETTINGS.keys())
    if str(settings.get("mode", "")) in (ServingMode.COLOCATED, ServingMode.COLOCATED.value):
        for name in ("prefill", "decode"):
            if name in settings:
                raise ValueError(f"{name}: disaggregated mode only; a colocated cluster takes workers "
                                 "(--workers N; default: one per GPU, else one)")
    serve = {field: settings[name] for name, field in SERVE_SETTINGS.items() if name in settings}
    serve["haproxy_ports_auto"] = frozenset(name for name in HAPROXY_PORTS if name not in settings)
    return ServeConfig(engine_config(settings, known=ENGINE_SETTINGS | SERVE_SETTINGS.keys()), **serve)


def engine_config(settings: Mapping[str, Any], progress: bool = False,
                  known: frozenset[str] | set[str] = ENGINE_SETTINGS) -> EngineConfig:
    """The EngineConfig the engine settings among `settings` describe (`pdserve generate`)."""
    _check_names(settings, known)
    if settings.get("model") is None:
        raise ValueError("model: required (an HF-format model directory)")
    if settings.get("speculative") is None:
        # Read only by speculative decoding: given without it they were taken and ignored (the
        # operator believed them in force), where draft_model is refused (EngineConfig). Checked on
        # the settings, not the config: a prefill worker's config drops speculation and keeps them.
        for name in _SPECULATIVE_ONLY:
            if settings.get(name) is not None:
                raise ValueError(f"{name}: a speculative decoding setting; give --speculative ngram or draft too")
    return EngineConfig(**{k: v for k, v in settings.items() if k in ENGINE_SETTINGS}, progress=progress)


def with_engine(cfg: ServeConfig, **changes: Any) -> ServeConfig:
    """`cfg` with some engine settings changed."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **changes))


def _check_names(settings: Mapping[str, Any], known: frozenset[str] | set[str]) -> None:
    for name in settings:
        if name not in known:
            raise ValueError(f"{name}: unknown setting (known: {', '.join(sorted(known))})")

