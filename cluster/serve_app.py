"""The Ray Serve application: worker actors plus the gateway ingress deployment."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

NAMESPACE = "pdserve"

# Ray Serve's HAProxy ingress (Ray >= 2.56): a C proxy forwards HTTP straight to
# the gateway replica's own server, instead of Serve's Python proxy actor
# relaying every request and every streamed chunk over Ray. Measured here
# (1P+1D, concurrency 16, 2 cores): the proxy actor took a sixth of the machine.
# Ray reads these when its processes start, so they must be in the environment
# of `ray start` (or of the process whose ray.init starts local Ray).
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# Local Ray only: the gateway replica's drain on shutdown waits (30 s by
# default) for load balancers on other nodes to stop sending; here there are none.
LOCAL_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


@dataclass(frozen=True)
class ServeConfig:
    """What `pdserve serve` and deploy/serve.yaml configure (validated here)."""

    model: str
    mode: str = "disaggregated"  # disaggregated | colocated (the baseline)
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    max_in_flight: int = 256
    transport: str = "zmq"  # zmq | nccl
    ingress: str = "haproxy"  # haproxy | proxy (Serve's Python proxy actor)
    router_policy: str = "cache_aware"  # cache_aware | round_robin (for comparison)
    # Where decode workers listen for KV, and the gateway for token streams:
    # loopback on one machine; "auto" = each one's node address (multi-node;
    # keep it on a private network).
    kv_bind_host: str = "127.0.0.1"
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode: must be colocated or disaggregated, got {self.mode!r}")
        if self.transport not in ("zmq", "nccl"):
            raise ValueError(f"transport: must be zmq or nccl, got {self.transport!r}")
        if self.ingress not in ("haproxy", "proxy"):
            raise ValueError(f"ingress: must be haproxy or proxy, got {self.ingress!r}")
        if self.router_policy not in ("cache_aware", "round_robin"):
            raise ValueError(f"router_policy: must be cache_aware or round_robin, got {self.router_policy!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("prefill/decode: each pool needs at least one worker")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")

    @property
    def num_workers(self) -> int:
        # Colocated: the same total number of workers as the disaggregated pools.
        return self.num_prefill + self.num_decode

    def worker_names(self) -> list[str]:
        if self.mode == "disaggregated":
            return self.prefill_names() + self.decode_names()
        return [f"pdserve-worker-{i}" for i in range(self.num_workers)]

    def prefill_names(self) -> list[str]:
        return [f"pdserve-prefill-{i}" for i in range(self.num_prefill)]

    def decode_names(self) -> list[str]:
        return [f"pdserve-decode-{i}" for i in range(self.num_decode)]

    def engine_config(self) -> dict[str, Any]:
        return {"model": self.model, "max_model_len": self.max_model_len, "block_size": self.block_size,
                **self.engine_args}


def start_workers(cfg: ServeConfig, timeout_s: float = 300.0) -> list[Any]:
    """Create the named worker actors (one GPU each on CUDA, a CPU share otherwise)."""
    from pdserve.cluster.actors import DecodeWorkerActor, EngineWorkerActor, PrefillWorkerActor

    gpus = ray.cluster_resources().get("GPU", 0)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    per_cpu = max(0.01, min(1.0, (cpus - 1) / cfg.num_workers)) if cpus > 1 else 0.01
    threads = max(1, cpus // cfg.num_workers) if not gpus else 1
    opts: dict[str, Any] = {"num_gpus": 1} if gpus else {"num_cpus": per_cpu}

    def make(actor_cls: Any, name: str, *args: Any) -> Any:
        # The actor's name is also its `worker` label in the metrics.
        return actor_cls.options(name=name, namespace=NAMESPACE, lifetime="detached", **opts).remote(
            cfg.engine_config(), threads, *args, worker_name=name)

    if cfg.mode == "disaggregated":
        workers = [make(PrefillWorkerActor, n, cfg.transport) for n in cfg.prefill_names()]
        workers += [make(DecodeWorkerActor, n, cfg.kv_bind_host, cfg.transport) for n in cfg.decode_names()]
    else:
        workers = [make(EngineWorkerActor, n) for n in cfg.worker_names()]
    ray.get([w.ready.remote() for w in workers], timeout=timeout_s)
    return workers


def build_gateway_app(cfg: ServeConfig) -> Any:
    """Runs on the gateway replica: tokenizer, backend over the named workers, routes."""
    from transformers import AutoTokenizer

    from pdserve.cluster.backend import ColocatedBackend, get_workers
    from pdserve.cluster.gateway import Gateway, GatewayConfig
    from pdserve.cluster.openai_app import build_app

    workers = get_workers(cfg.worker_names(), NAMESPACE)
    limits = ray.get(workers[-1].ready.remote(), timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    gw_cfg = GatewayConfig(model_name=os.path.basename(cfg.model.rstrip("/")) or cfg.model,
                           max_model_len=limits["max_model_len"], api_key=cfg.api_key, max_in_flight=cfg.max_in_flight)
    backend = (_disaggregated_backend(cfg) if cfg.mode == "disaggregated"
               else ColocatedBackend(workers, stream_host=cfg.kv_bind_host, names=cfg.worker_names()))
    return build_app(Gateway(backend, tokenizer, gw_cfg))


def _disaggregated_backend(cfg: ServeConfig) -> Any:
    from pdserve.cluster.disagg_backend import DisaggregatedBackend
    from pdserve.cluster.router import Router
    from pdserve.cluster.router.policy import RouterConfig, RoutingPolicy

    names = {f"p{i}": n for i, n in enumerate(cfg.prefill_names())}
    names.update({f"d{i}": n for i, n in enumerate(cfg.decode_names())})
    prefill = {f"p{i}": ray.get_actor(n, namespace=NAMESPACE) for i, n in enumerate(cfg.prefill_names())}
    decode = {f"d{i}": ray.get_actor(n, namespace=NAMESPACE) for i, n in enumerate(cfg.decode_names())}
    addresses = {wid: ray.get(a.ready.remote(), timeout=60)["address"] for wid, a in decode.items()}
    router = Router(RouterConfig(policy=RoutingPolicy(cfg.router_policy)), cfg.block_size)
    return DisaggregatedBackend(prefill, decode, addresses, router, stream_host=cfg.kv_bind_host, names=names)


def gateway_app(cfg: ServeConfig) -> serve.Application:
    ingress = serve.ingress(lambda: build_gateway_app(cfg))()
    deployment = serve.deployment(ingress, name="pdserve-gateway", num_replicas=1,
                                  ray_actor_options={"num_cpus": 0.01},
                                  max_ongoing_requests=cfg.max_in_flight * 2)
    return deployment.bind()


def init_ray(cfg: ServeConfig, **kwargs: Any) -> None:
    """ray.init (local Ray, or RAY_ADDRESS) with the environment `cfg.ingress` needs.
    A cluster that is already running keeps the ingress it was started with."""
    if cfg.ingress == "haproxy":
        for key, value in HAPROXY_ENV.items():
            os.environ.setdefault(key, value)
    else:
        for key in HAPROXY_ENV:
            os.environ.setdefault(key, "0")
    if not ray.is_initialized():
        if not os.environ.get("RAY_ADDRESS") and "address" not in kwargs:
            for key, value in LOCAL_ENV.items():
                os.environ.setdefault(key, value)
        ray.init(namespace=NAMESPACE, include_dashboard=False, **kwargs)


def run(cfg: ServeConfig, block: bool = True) -> None:
    """Start local Ray (or join RAY_ADDRESS), the workers, and the HTTP gateway."""
    init_ray(cfg)
    start_workers(cfg)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(gateway_app(cfg), name="pdserve", route_prefix="/")
    print(f"[pdserve] serving {cfg.model} on http://{cfg.host}:{cfg.port}/v1 ({cfg.mode}, {cfg.num_workers} workers)",
          flush=True)
    if block:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            shutdown(cfg)


def shutdown(cfg: ServeConfig) -> None:
    serve.shutdown()
    for name in cfg.worker_names():
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
