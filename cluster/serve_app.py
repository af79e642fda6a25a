"""The Ray Serve application: worker actors plus the gateway ingress deployment."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.schema import ApplicationStatus

from pdserve.cluster import drain_flag, port_lock, ray_vitals
from pdserve.cluster.background_priority import deprioritize_background
from pdserve.cluster.blocking_call import call_within
from pdserve.cluster.cpu_pinning import REFRESH_S, CpuPinning, Pins, apply, node_cores, plan
from pdserve.cluster.drain_flag import DrainWatch
from pdserve.cluster.ingress import check_ray_template, haproxy_threads, knob_env, wrapper_env
from pdserve.cluster.ingress_config import IngressSettings
from pdserve.cluster.ingress_watch import IngressWatch
from pdserve.cluster.leftovers import (
    check_ports,
    free_port,
    haproxy_run_dir,
    live_holder,
    port_released,
    remove_run_dir,
)
from pdserve.cluster.local_env import LOCAL_ENV
from pdserve.cluster.metrics_peers import RayKVStore
from pdserve.cluster.placement import check_listenable, with_resources
from pdserve.cluster.ray_vitals import ControlPlaneLost, Vital, VitalsWatch, find_vitals
from pdserve.cluster.reports import WorkerInfo
from pdserve.cluster.router.policy import WorkerRole
from pdserve.cluster.serve_config import HAPROXY_PORTS, Ingress, ServeConfig, ServingMode
from pdserve.cluster.shutdown import DRAIN_S
from pdserve.cluster.worker_start import (
    NAMESPACE,
    create_workers,
    find_worker,
    first_worker_info,
    kill_workers,
    wait_for_workers,
)
from pdserve.workers import generation_defaults
from pdserve.workers.cpu_turns import remove_node_files

if TYPE_CHECKING:
    from pdserve.cluster.disagg_backend import DisaggregatedBackend
    from pdserve.cluster.gateway import GatewayConfig
    from pdserve.cluster.planner.role_loop import PlannerSettings

log = logging.getLogger(__name__)

APP_NAME = "pdserve"  # the gateway's Serve app
# How long the gateway app may take to run once its workers are up: a replica's start (imports,
# the tokenizer, `_any_worker_info`'s 120 s at most) is well under it; Serve itself would wait for
# ever for a replica no node can place (`--gateway-resources` naming a resource no node offers).
GATEWAY_START_S = 300.0
GATEWAY_POLL_S = 0.5
# How long a gateway replica waits for a worker to answer, at the least (a replica started again
# while every worker restarts); one started with the app waits as long as the workers' start may take.
WORKER_INFO_S = 120.0
# How long "serving" waits for HAProxy's guard (cluster/ingress_watch.py) once the app is up:
# it is in by then unless the node is badly overloaded.
GUARD_WAIT_S = 30.0
# The longest one call on Serve's controller may take (blocking_call.py): its start, a deploy, a
# status. Longer, and the controller is taken for hung: the start ends, naming it.
SERVE_CALL_S = 120.0

# Ray Serve's HAProxy ingress (Ray >= 2.56): a C proxy forwards HTTP straight to
# the gateway replica's own server, instead of Serve's Python proxy actor
# relaying every request and every streamed chunk over Ray, which takes a large
# share of a small machine's CPU (docs/performance.md). Ray reads these
# when its processes start, so they must be in the environment of `ray start`
# (or of the process whose ray.init starts local Ray).
HAPROXY_SWITCH = "RAY_SERVE_ENABLE_HA_PROXY"  # Serve's ingress: HAProxy (1) or its Python proxy (0)
HAPROXY_ENV = {HAPROXY_SWITCH: "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# HAProxy sends a request to another gateway replica when the one it chose closed the connection
# without a byte of response (empty-response), not only when the connection failed (Ray's
# default). A SIGKILLed replica's sockets stay open while its process is torn down (0.2-0.8 s on 2
# busy cores): what HAProxy sent it then, or had sent it just before, was lost, /health included
# (docs/reliability.md, (m)). A response already begun (a stream) is never sent again, nor is a
# POST (cluster/ingress_config.py: `disable-l7-retry` unless GET or HEAD): a request that itself
# killed its replica must not be tried on the next (the poison-pill rule); a POST in flight on a
# dying replica fails with a 5xx, as a stream does.
HAPROXY_RETRY_ENV = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response"}


def haproxy_env(cfg: ServeConfig) -> dict[str, str]:
    """Where local Ray's HAProxy ingress listens and keeps its files: the ports
    `cfg` names (Ray's defaults are fixed: 9101, 8404, and 8500 for Serve's
    Python proxy that HAProxy falls back to) and the run's own
    directory (leftovers.haproxy_run_dir) for its config file and sockets, so two
    runs never share them (ray/serve/_private/constants.py reads these variables
    when a Ray process starts; Ray adds a directory per node under the paths).
    That directory is made private here, and HAProxy hardened and restarted
    quickly when it dies (cluster/ingress.py); IngressDirError or
    IngressConfigError (a Ray whose config pdserve cannot harden) before Ray starts."""
    run_dir = haproxy_run_dir(cfg.port)
    settings = IngressSettings(max_connections_per_client=cfg.max_connections_per_client,
                               header_timeout_s=cfg.header_timeout, keep_alive_timeout_s=cfg.keep_alive_timeout)
    check_ray_template(settings)
    return wrapper_env(run_dir, settings) | {
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(cfg.haproxy_metrics_port),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(cfg.haproxy_stats_port),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(cfg.haproxy_fallback_port),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(run_dir, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(run_dir, "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(run_dir, "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": run_dir,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(run_dir, "server-state"),
    }


def haproxy_knobs(cfg: ServeConfig) -> dict[str, str]:
    """Ray Serve's own HAProxy knobs, as `cfg` sets them (cluster/ingress.py): the cap
    on connections in all, the client timeout, how soon a dead HAProxy is restarted."""
    return knob_env(cfg.max_connections, cfg.request_timeout)


def bound_ports(cfg: ServeConfig) -> dict[int, str]:
    """Every port a local run binds on this machine, with the flag that moves it
    (Ray's own ports are picked free at start)."""
    ports = {cfg.port: "--port"}
    if cfg.ingress is Ingress.HAPROXY:
        ports |= {cfg.haproxy_metrics_port: "--haproxy-metrics-port", cfg.haproxy_stats_port: "--haproxy-stats-port",
                  cfg.haproxy_fallback_port: "--haproxy-fallback-port"}
    return ports


def starts_local_ray() -> bool:
    """Whether init_ray starts a new local Ray (rather than joining RAY_ADDRESS or
    a cluster that `ray start` left running on this machine)."""
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return False
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(None) is None
    except Exception:  # noqa: BLE001 - a private Ray API: if it fails, assume a new local Ray
        return True


def cluster_gpus() -> float:
    """GPUs in the Ray cluster now (Ray is up)."""
    return float(ray.cluster_resources().get("GPU", 0))


def node_gpus() -> list[float]:
    """GPUs of each live node of the Ray cluster now (a tensor-parallel worker's lie on one)."""
    return [float(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]


def build_gateway_app(cfg: ServeConfig) -> Any:
    """Runs on the gateway replica: tokenizer, backend over the named workers, routes."""
    from transformers import AutoTokenizer

    from pdserve.workers.info_log import replica_logger

    replica_logger()  # the gateway's own lines, on the console and in its log file as they come

    from pdserve.cluster.backend import ColocatedBackend
    from pdserve.cluster.gateway import Gateway
    from pdserve.cluster.openai_app import build_app
    from pdserve.workers.engine_setup import tokenizer_source
    from pdserve.workers.model.resolve import resolve_model

    # Sent while the workers build their engines (`_start_and_serve`): it waits as long as the start does.
    info = _any_worker_info(cfg, max(WORKER_INFO_S, cfg.worker_start_timeout))
    model_dir = str(resolve_model(cfg.model))  # a GGUF or `tiny`: the directory it was made into
    # The workers' tokenizer (`--tokenizer`, else the model's): prompts encoded with one and outputs
    # decoded with another would not agree.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(cfg.engine.tokenizer, model_dir))
    if cfg.chat_template is not None:  # --chat-template: every chat (and /tokenize's) renders with it
        tokenizer.chat_template = cfg.chat_template
    rank = replica_rank()
    # Serve's ingress gives every request an x-request-id (the client's, else its own) and writes
    # it on the response: the gateway takes it as its requests' ids begin and writes none of its own.
    gw_cfg = dataclasses.replace(gateway_config(cfg, info.max_model_len, model_dir, rank),
                                 server_writes_request_id=True)
    backend = (_disaggregated_backend(cfg, rank) if cfg.mode is ServingMode.DISAGGREGATED
               else ColocatedBackend([find_worker(n) for n in cfg.worker_names()], stream_host=cfg.kv_host,
                                     names=cfg.worker_names(), max_migrations=cfg.max_migrations,
                                     lookup=find_worker, worker_wait_s=cfg.worker_wait,
                                     cluster_secret=cfg.cluster_secret, stream_interval=cfg.stream_interval,
                                     stall_timeout_s=cfg.stall_timeout,
                                     replica=(rank, cfg.gateway_replicas or 1)))
    gateway = Gateway(backend, tokenizer, gw_cfg)
    gateway.drain_watch = DrainWatch(cfg.port, gateway.drain)  # a stop's drain: no new requests
    if gw_cfg.replicas > 1:  # each replica's metrics in every replica's /metrics (cluster/metrics_peers.py)
        gateway.metrics.peers = RayKVStore()
    return build_app(gateway)


def replica_rank() -> int:
    """This gateway replica's rank among the deployment's (0 .. replicas - 1; Serve keeps
    the ranks dense and gives a restarted replica its predecessor's), 0 outside Serve."""
    try:
        rank = serve.get_replica_context().rank
    except Exception:  # noqa: BLE001 - not in a replica (a test building the app in-process)
        return 0
    return int(getattr(rank, "rank", rank))


def gateway_config(cfg: ServeConfig, max_model_len: int, model_dir: str, rank: int = 0) -> GatewayConfig:
    """The settings of gateway replica `rank`: the API answers to `cfg.served_names` and
    reports the first; /v1/models' `root` is `model_dir`, where a client finds the
    tokenizer; it admits its share of `max_in_flight`. The planner runs in replica 0
    only: two planners would move the same workers."""
    from pdserve.cluster.gateway import GatewayConfig

    names = cfg.served_names
    return GatewayConfig(model_name=names[0], aliases=names[1:], model_root=model_dir, max_model_len=max_model_len,
                         api_key=cfg.api_key, metrics_api_key=cfg.metrics_api_key,
                         max_in_flight=cfg.admission_share(rank), request_timeout_s=cfg.request_timeout,
                         max_logprobs=cfg.engine.max_logprobs,
                         limits=cfg.limits, vocab_size=_vocab_size(model_dir),
                         planner=_replica_planner(cfg, rank), replica=rank, replicas=cfg.gateway_replicas or 1,
                         sampling_defaults=(generation_defaults.read(model_dir, cfg.generation_config)
                                            | cfg.override_generation_config),
                         exclude_tools_when_tool_choice_none=cfg.exclude_tools_when_tool_choice_none,
                         return_tokens_as_token_ids=cfg.return_tokens_as_token_ids,
                         reasoning_parser=cfg.reasoning_parser, cors=cfg.cors,
                         default_template_kwargs=dict(cfg.default_chat_template_kwargs),
                         tool_call_parser=cfg.tool_call_parser, log_requests=cfg.enable_log_requests,
                         log_outputs=cfg.enable_log_outputs, max_log_len=cfg.max_log_len,
                         fastapi_docs=not cfg.disable_fastapi_docs,
                         force_include_usage=cfg.enable_force_include_usage)


def _replica_planner(cfg: ServeConfig, rank: int) -> PlannerSettings | None:
    """Replica 0's planner, which sees 1 / replicas of the traffic; None elsewhere."""
    if cfg.planner is None or rank != 0:
        return None
    settings: PlannerSettings = dataclasses.replace(cfg.planner, replicas=cfg.gateway_replicas or 1)
    return settings


def _vocab_size(model_dir: str) -> int | None:
    """The model's vocabulary (the token ids a request may name), or None (the
    gateway then takes its tokenizer's size) when its config cannot be read."""
    from pdserve.workers.model.config import ModelConfig

    try:
        return ModelConfig.from_pretrained(model_dir).vocab_size
    except (OSError, ValueError, KeyError):
        return None


def _any_worker_info(cfg: ServeConfig, timeout_s: float = WORKER_INFO_S) -> WorkerInfo:
    """What the workers say of the model, from the first that answers (`first_worker_info`)."""
    return first_worker_info(cfg.worker_names(), timeout_s, lookup=find_worker)


def _disaggregated_backend(cfg: ServeConfig, rank: int = 0) -> DisaggregatedBackend:
    from pdserve.cluster.disagg_backend import DisaggregatedBackend
    from pdserve.cluster.router import Router
    from pdserve.cluster.router.policy import RouterConfig

    names = {f"p{i}": n for i, n in enumerate(cfg.prefill_names())}
    names.update({f"d{i}": n for i, n in enumerate(cfg.decode_names())})
    prefill = {f"p{i}": find_worker(n) for i, n in enumerate(cfg.prefill_names())}
    decode = {f"d{i}": find_worker(n) for i, n in enumerate(cfg.decode_names())}
    backlog = cfg.prefill_backlog_tokens(cluster_gpus())
    router = Router(RouterConfig(policy=cfg.router_policy, max_prefill_backlog_tokens=backlog), cfg.engine.block_size,
                    replica=(rank, cfg.gateway_replicas or 1))
    return DisaggregatedBackend(prefill, decode, router, stream_host=cfg.kv_host, names=names,
                                lookup=find_worker, max_migrations=cfg.max_migrations, worker_wait_s=cfg.worker_wait,
                                cluster_secret=cfg.cluster_secret, poll_s=cfg.load_poll_interval,
                                stall_timeout_s=cfg.stall_timeout, stream_interval=cfg.stream_interval)


def gateway_app(cfg: ServeConfig) -> serve.Application:
    ingress = serve.ingress(lambda: build_gateway_app(cfg))()
    replicas = cfg.gateway_replicas or 1
    # Serve's defaults (its access log on, INFO) but for what the flags turn down
    log_cfg: dict[str, Any] = {}
    if cfg.disable_uvicorn_access_log:
        log_cfg["enable_access_log"] = False
    if cfg.uvicorn_log_level is not None:  # uvicorn's "trace" is below Python's levels: DEBUG
        log_cfg["log_level"] = {"trace": "DEBUG"}.get(cfg.uvicorn_log_level, cfg.uvicorn_log_level.upper())
    quiet: dict[str, Any] = {"logging_config": log_cfg} if log_cfg else {}
    deployment = serve.deployment(ingress, name="pdserve-gateway", num_replicas=replicas,
                                  ray_actor_options=with_resources({"num_cpus": 0.01}, cfg.gateway_resources),
                                  max_ongoing_requests=cfg.admission_share(0) * 2, **quiet)
    return deployment.bind()


def init_ray(cfg: ServeConfig, **kwargs: Any) -> None:
    """ray.init (local Ray, or RAY_ADDRESS) with the environment `cfg.ingress` needs.
    A cluster that is already running keeps the ingress it was started with, and where
    this process's Ray is up already nothing changes (its environment is not touched:
    a later Ray start in it, or a process it starts, would inherit what was set here).
    On a local start `cfg.ingress` decides RAY_SERVE_ENABLE_HA_PROXY whatever the
    environment says: a variable left exported must not swap the ingress the flag names."""
    if ray.is_initialized():
        return
    local = not os.environ.get("RAY_ADDRESS") and "address" not in kwargs
    if cfg.ingress is Ingress.HAPROXY:
        for key, value in (HAPROXY_ENV | HAPROXY_RETRY_ENV).items():
            os.environ.setdefault(key, value)
    else:
        for key in HAPROXY_ENV:
            os.environ.setdefault(key, "0")
    if local:
        os.environ[HAPROXY_SWITCH] = "1" if cfg.ingress is Ingress.HAPROXY else "0"
        for key, value in LOCAL_ENV.items():
            os.environ.setdefault(key, value)
        if cfg.ingress is Ingress.HAPROXY:
            os.environ.update(haproxy_env(cfg) | haproxy_knobs(cfg))  # the flags', over any variable already set
            os.environ.setdefault("RAY_SERVE_HAPROXY_NBTHREAD", str(haproxy_threads(len(node_cores()))))
    ray.init(namespace=NAMESPACE, include_dashboard=False, **kwargs)


def settle_haproxy_ports(cfg: ServeConfig) -> ServeConfig:
    """`cfg` with each HAProxy port left to pdserve (`haproxy_ports_auto`) that another live process
    holds moved to a free port, saying so in one line. Ray's defaults are the same for every run,
    so a second `pdserve serve` on another --port met the first one's HAProxy on 9101. A port named
    by its flag never moves (`check_ports` then names its holder); an earlier run's orphaned HAProxy
    is no reason to move (`check_ports` stops it). Local Ray only, before it starts."""
    if cfg.ingress is not Ingress.HAPROXY or not cfg.haproxy_ports_auto:
        return cfg
    if live_holder(cfg.port) is not None:  # this port's own run, most likely: the preflight says so, nothing moves
        return cfg
    moved: dict[str, Any] = {}  # (Any: dataclasses.replace's keywords are typed per field)
    taken = {cfg.port, *(getattr(cfg, name) for name in HAPROXY_PORTS)}
    for name in HAPROXY_PORTS:
        port = getattr(cfg, name)
        holder = live_holder(port) if name in cfg.haproxy_ports_auto else None
        if holder is None:
            continue
        moved[name] = new = free_port(avoid=taken)
        taken.add(new)
        flag = "--" + name.replace("_", "-")
        print(f"[pdserve] port {port} ({flag}'s default) is in use by {holder}: this run's HAProxy takes {new} "
              f"instead ({flag} names a port)", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, **moved) if moved else cfg


def preflight(cfg: ServeConfig) -> bool:
    """What can stop a start before anything starts: on local Ray (returned: whether it is),
    another local run on this HTTP port, starting or serving (cluster/port_lock.py: held
    from here to `stop_ray`), is a PortInUseError; an earlier run's orphaned HAProxy on
    one of this run's ports is stopped, and any other process there is a PortInUseError."""
    local = starts_local_ray()
    if local:
        check_listenable(cfg.host)  # this machine's own address: before Ray and the workers start
        port_lock.hold(cfg.port)
        try:
            check_ports(bound_ports(cfg))
        except BaseException:
            port_lock.release(cfg.port)
            raise
    return local


def run(cfg: ServeConfig, block: bool = True) -> ServeConfig:
    """Start local Ray (or join RAY_ADDRESS), the workers, and the HTTP gateway.
    Before local Ray starts, an earlier run's orphaned HAProxy on one of this
    run's ports is stopped; any other process there is a PortInUseError. Returns `cfg`
    with what it decided (the colocated worker count)."""
    if starts_local_ray():
        cfg = settle_haproxy_ports(cfg)
    local = preflight(cfg)
    try:
        return _start_and_serve(cfg, block, local)
    except BaseException:
        # A start that failed holds the port no more (a caller in process, a test or a library,
        # would otherwise keep every later run off it until it exits).
        port_lock.release(cfg.port)
        raise


def _start_and_serve(cfg: ServeConfig, block: bool, local: bool) -> ServeConfig:
    """`run` once its ports are checked (`local`: it starts local Ray)."""
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[pdserve] warning: serving on {cfg.host} with no API key: anyone who can reach the port can use "
              "it (set PDSERVE_API_KEY or --api-key-file; docs/security.md)", file=sys.stderr, flush=True)
    init_ray(cfg)
    drain_flag.lower_flag(cfg.port)  # an earlier run's stop, on a Ray cluster that outlived it
    cfg = cfg.fit_to_cluster(cluster_gpus, node_gpus)
    workers = create_workers(cfg)
    sent = False  # the gateway app, to Serve
    try:
        # Serve's controller, proxy and HAProxy start while the workers load and compile their
        # models (seconds of each start, minutes of a compile): the gateway app waits for them.
        try:
            call_within(lambda: serve.start(http_options={"host": cfg.host, "port": cfg.port}), SERVE_CALL_S,
                        "Ray Serve's controller (its start)")
        except TimeoutError as e:
            raise ValueError(str(e)) from None
        # The gateway's replica starts (its process, its imports, the tokenizer) while the workers
        # still build their engines; it waits for one to answer (`_any_worker_info`). Sent after
        # the workers were up, that start came on top of theirs: 7-9 s of a tiny model's 40-50 s
        # start on 2 loaded cores.
        send_gateway(cfg)
        sent = True
        # `--dtype auto` as the workers resolved it
        dtype = wait_for_workers(workers, cfg.worker_start_timeout, cfg.worker_names())[0].dtype
    except Exception:
        if sent:  # its replica would wait for workers that are gone
            delete_gateway()
        # Detached actors outlive this driver: on a cluster it joined, a failed start's workers held
        # their cores or GPUs, and the next start failed on their names ("already taken"). (A
        # KeyboardInterrupt's stop, run_until_stopped's, stops them by name.)
        kill_workers(workers)
        raise
    # A dead HAProxy started again within a second by its manager (cluster/haproxy_guard.py), not
    # after Ray replaces the manager: the guard goes in as soon as the manager exists, before the
    # app is up (/health can answer 200 seconds before serve.run returns on a loaded machine).
    watch = (IngressWatch(ray.get_runtime_context().get_node_id()).start()
             if local and block and cfg.ingress is Ingress.HAPROXY else None)
    try:
        deploy_gateway(cfg, sent=True)
    except BaseException as e:
        if watch is not None:
            watch.stop()
        if isinstance(e, Exception):  # (a KeyboardInterrupt's stop, run_until_stopped's, stops them)
            kill_workers(workers)
        raise
    if watch is not None and not watch.wait_installed(GUARD_WAIT_S):
        # "serving" promises a HAProxy restarted within a second; until the guard is in, a dead
        # one waits for Ray's own path (its controller replacing the manager: 7-31 s under load).
        print(f"[pdserve] warning: HAProxy's guard is not in its manager after {GUARD_WAIT_S:.0f} s; until it is, "
              "a dead HAProxy is restarted by Ray Serve's controller (seconds slower)", file=sys.stderr, flush=True)
    cores = node_cores()  # before any pinning narrows this process's own
    # Only `pdserve serve`'s own process (block): a caller's process is not ours to pin.
    pins = pin_decode_cores(cfg, cores) if local and block else None
    if local:
        deprioritize_background(cfg.control_plane_nice, proxy_is_ingress=cfg.ingress is Ingress.PROXY)
    pinned = "" if pins is None else f"; decoding workers on cores of their own, the rest on {sorted(pins.rest)}"
    # Local Ray's GCS and raylet: nothing replaces either (cluster/ray_vitals.py).
    vitals = VitalsWatch(find_vitals(), _control_plane_lost).start() if local and block else None
    print(f"[pdserve] serving {cfg.model} on http://{cfg.host}:{cfg.port}/v1 "
          f"({cfg.mode.value}, {cfg.num_workers} workers, {dtype}{pinned})", flush=True)
    if block:
        try:
            while True:
                time.sleep(REFRESH_S if local else 3600)
                if local and not ray_vitals.lost():  # a restarted worker, or one that changed role, gets its cores
                    pins = pin_decode_cores(cfg, cores, pins)
        except KeyboardInterrupt:
            if watch is not None:
                watch.stop()  # its calls would only find a manager shutting down
            if vitals is not None:
                vitals.stop()
                gone = ray_vitals.lost()
                if gone is not None:  # Serve's and Ray's shutdown need what is gone
                    raise ControlPlaneLost(gone) from None
            shutdown(cfg)
    return cfg  # with the worker count it decided


def _control_plane_lost(vital: Vital) -> None:
    """The vitals watch's call: say what went, keep Ray's busy polling of a dead GCS off the
    engines' cores, and begin the stop a SIGTERM begins (its drain, then ControlPlaneLost)."""
    print(f"[pdserve] local Ray lost {vital.describe()}: it cannot go on without it. Draining the requests "
          f"in flight (up to {DRAIN_S:g} s), then stopping and exiting 1, for a supervisor to start pdserve "
          "again", file=sys.stderr, flush=True)
    ray_vitals.nice_all_threads(19)
    os.kill(os.getpid(), signal.SIGINT)


def send_gateway(cfg: ServeConfig) -> None:
    """The gateway app to Serve, not waited for (`deploy_gateway` waits). ValueError (the CLI's
    one line) where Serve's controller does not take it within `SERVE_CALL_S`."""
    target = serve.RunTarget(gateway_app(cfg), name=APP_NAME, route_prefix="/")
    try:
        # Serve's calls wait on its controller with no timeout of their own (blocking_call.py)
        call_within(lambda: serve.run_many([target], wait_for_applications_running=False), SERVE_CALL_S,
                    "Ray Serve's controller (the gateway's deploy)")
    except TimeoutError as e:
        delete_gateway()
        raise ValueError(f"the gateway is not up: {e}") from None


def delete_gateway() -> None:
    """Delete the gateway app, not waiting for it to go, best effort (a replica placed later must
    not serve stopped workers)."""
    with contextlib.suppress(Exception):
        call_within(lambda: serve.delete(APP_NAME, _blocking=False), 10.0, "Ray Serve's controller (a delete)")


def deploy_gateway(cfg: ServeConfig, sent: bool = False) -> None:
    """serve.run's deploy of the gateway app (`sent`: `send_gateway` sent it already), with a
    deadline: Serve waits for ever for a replica no node can place (it only updates the app's
    message). RuntimeError where the deploy failed; ValueError (the CLI's one line) with Serve's
    reason past `GATEWAY_START_S` from now, the app deleted."""
    if not sent:
        send_gateway(cfg)
    app: Any = None
    deadline = time.monotonic() + GATEWAY_START_S
    try:
        while True:
            app = call_within(lambda: serve.status().applications.get(APP_NAME), SERVE_CALL_S,
                              "Ray Serve's controller (the gateway's status)")
            status = None if app is None else app.status
            if status == ApplicationStatus.RUNNING:
                return
            if status == ApplicationStatus.DEPLOY_FAILED:  # as serve.run says it
                raise RuntimeError(f"Deploying application {APP_NAME} failed: {app.message if app else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"within {GATEWAY_START_S:g} s: {_app_reason(app)}")
            time.sleep(GATEWAY_POLL_S)
    except TimeoutError as e:  # the deadline, or a controller that did not answer a call
        delete_gateway()
        raise ValueError(f"the gateway is not up {e}" if str(e).startswith("within ")
                         else f"the gateway is not up: {e}") from None


def _app_reason(app: Any) -> str:
    """What Serve says of an app that is not up: its deployments' messages (a replica that cannot
    be scheduled names the resources it requires), else its own."""
    if app is None:
        return "Serve has no such app"
    said = [d.message for d in app.deployments.values() if d.message] or [app.message]
    return " ".join(m.strip() for m in said if m) or f"Serve says {app.status}"


def pin_decode_cores(cfg: ServeConfig, cores: frozenset[int], pinned: Pins | None = None,
                     timeout_s: float = 30.0, root: int | None = None) -> Pins | None:
    """On local Ray, each CPU worker that decodes (a decode worker, or any colocated one) with a
    fixed share of threads onto cores of its own, and everything else this process started onto
    the others (cluster/cpu_pinning.py). `pinned`:
    what the last call did (where nothing can be pinned now, everything gets every core back).
    Returns what is pinned now; a worker that does not answer leaves things as they were.
    `root`: the process whose tree is pinned (default: this one, which started local Ray)."""
    if cfg.cpu_pinning is CpuPinning.OFF or cluster_gpus():
        return None
    try:
        handles = [ray.get_actor(name, namespace=NAMESPACE) for name in cfg.worker_names()]
        infos: list[WorkerInfo] = ray.get([h.info.remote() for h in handles], timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - a worker restarting: the next call tries again
        log.debug("CPU pinning: workers did not answer (%r); pins left as they were", e)
        return pinned
    colocated = cfg.mode is ServingMode.COLOCATED
    pins = plan(cores, [(i.pid, i.fixed_cpu_threads) for i in infos if colocated or i.role is WorkerRole.DECODE])
    if pins is not None:
        apply(pins, root)
        if pins != pinned:
            log.info("CPU pinning: decoding workers %s, everything else on cores %s",
                     {pid: sorted(c) for pid, c in pins.decode.items()}, sorted(pins.rest))
    elif pinned is not None:  # everything back on every core
        apply(Pins({}, cores), root)
    return pins


def stop_ray(cfg: ServeConfig) -> None:
    """Stop this process's Ray (ray.shutdown: local Ray's processes end with it), then remove
    the files the run kept on this machine for its port: the HAProxy directory, the CPU
    workers' turns lock and lending directory. Left where the port is still in use
    afterwards: another run's, named by the same port."""
    ray.shutdown()
    remove_run_files(cfg)


def remove_run_files(cfg: ServeConfig) -> None:
    """What `stop_ray` removes once Ray has stopped (also once the driver stopped local Ray's
    processes by pid: cluster/ray_vitals.py)."""
    if port_released(cfg.port):
        if cfg.ingress is Ingress.HAPROXY:
            remove_run_dir(cfg.port)
        remove_node_files(f"{NAMESPACE}-{cfg.port}")
    with contextlib.suppress(OSError):  # the drain's file (cluster/drain_flag.py)
        os.unlink(drain_flag.flag_path(cfg.port))
    port_lock.release(cfg.port)


def shutdown(cfg: ServeConfig) -> None:
    cfg = cfg.fit_to_cluster(cluster_gpus, node_gpus)  # the same count `run` decided on this cluster
    serve.shutdown()
    for name in cfg.worker_names():
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
