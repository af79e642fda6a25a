"""Ray Serve application builder for deploy/serve.yaml.

Ray Serve's builder convention: the config names `import_path: deploy.pdserve_app:app`
and Serve calls `app(args)` with the application's `args:` mapping from the YAML.
`app` validates the args into a `ServeConfig`, (re)starts the named prefill/decode
worker actors, and returns the gateway application (`gateway_app(cfg)`).

Where it runs: under `serve run deploy/serve.yaml` / `serve deploy deploy/serve.yaml`
Serve calls the builder inside its build task on the cluster, so the repository root
must be on PYTHONPATH of every Ray node (deploy/cluster.yaml exports it before
`ray start`; locally: `PYTHONPATH=$PWD serve run deploy/serve.yaml`). Ray is already
initialised there; under `serve run deploy.pdserve_app:app model=...` (an import
path, not a config file) Serve calls the builder before it connects to Ray, so the
builder connects itself (RAY_ADDRESS, else a cluster running on this machine, else a
new local one).

Every build replaces the worker actors: a redeploy with changed args (another model,
other pool sizes) must not keep workers that were built for the old ones. That means
a redeploy reloads the model; requests in flight on the old workers fail.

Stop the app and its workers (they are detached actors and outlive the app):

    python -m deploy.pdserve_app stop deploy/serve.yaml
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

from ray import serve

from pdserve.cluster.serve_app import cluster_gpus, gateway_app, node_gpus
from pdserve.cluster.serve_config import ENGINE_SETTINGS, SERVE_SETTINGS, ServeConfig, serve_config
from pdserve.cluster.worker_start import NAMESPACE, start_workers

_KEYS = ("api_key", "metrics_api_key")  # each given inline, or as `<name>_env` or `<name>_file`
_KEY_ARGS = tuple(f"{name}{form}" for name in _KEYS for form in ("", "_env", "_file"))
_BUILDER_ARGS = {"engine_args", "worker_timeout_s", "wait_for_gpus_s", *_KEY_ARGS}
# Set elsewhere under Serve: refuse them rather than ignore them.
_ELSEWHERE = {"host": "http_options.host in the Serve config", "port": "http_options.port in the Serve config",
              "haproxy_metrics_port": "RAY_SERVE_HAPROXY_METRICS_PORT in the environment of `ray start`",
              "haproxy_stats_port": "RAY_SERVE_HAPROXY_STATS_PORT in the environment of `ray start`",
              "haproxy_fallback_port": "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT in the environment of `ray start`",
              "max_connections": "RAY_SERVE_HAPROXY_MAXCONN in the environment of `ray start`",
              "ingress": "RAY_SERVE_ENABLE_HA_PROXY in the environment of `ray start`",
              # What `pdserve serve` writes into the HAProxy it starts on local Ray (cluster/ingress.py).
              **dict.fromkeys(("max_connections_per_client", "header_timeout", "keep_alive_timeout"),
                              "nothing here: `pdserve serve` sets it in the HAProxy it starts on local Ray; "
                              "a `ray start` cluster's HAProxy runs Ray Serve's own config"),
              # What `pdserve serve` does to the processes of the local Ray it starts.
              **dict.fromkeys(("cpu_pinning", "control_plane_nice"),
                              "nothing here: `pdserve serve` applies it to the local Ray it starts"),
              "worker_start_timeout": "worker_timeout_s, the application builder's wait for its workers"}

_WORKER_NAME = re.compile(r"pdserve-(worker|prefill|decode)-\d+")


@dataclasses.dataclass(frozen=True)
class DeployArgs:
    """The validated `args:` of the pdserve application."""

    config: ServeConfig
    worker_timeout_s: float = 900.0  # model load on every worker, plus autoscaling a GPU node
    wait_for_gpus_s: float = 0.0  # > 0: wait this long for a GPU in the cluster, then fail (no CPU fallback)


def parse_args(args: Mapping[str, Any] | None) -> DeployArgs:
    """Validate the YAML `args:`; every error is a ValueError that starts with the arg's name.

    The args are `pdserve serve`'s settings (cluster/serve_config.py), engine
    settings at the top level or under `engine_args:`, plus what only a Serve
    deployment has: the API key from a file or the environment, and the builder's waits."""
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(f"args: must be a mapping, got {type(args).__name__}")
    for key in args:
        if key in _ELSEWHERE:
            raise ValueError(f"{key}: not an application arg under Ray Serve (it would be ignored); "
                             f"set {_ELSEWHERE[key]}")
        if key not in SERVE_SETTINGS and key not in ENGINE_SETTINGS and key not in _BUILDER_ARGS:
            known = sorted({*SERVE_SETTINGS, *ENGINE_SETTINGS, *_BUILDER_ARGS})
            raise ValueError(f"{key}: unknown arg (known: {', '.join(known)})")
    settings = {k: v for k, v in args.items() if k not in _BUILDER_ARGS} | _engine_args(args)
    if not settings.get("model"):  # at the top level or under engine_args, as every engine setting
        raise ValueError("model: required (an HF-format model directory present on every node)")
    for name in _KEYS:
        settings[name] = _key(args, name)
    cfg = serve_config(settings)  # its own checks raise ValueError("mode: ...") and so on

    extra: dict[str, float] = {}
    for key, least in (("worker_timeout_s", 1), ("wait_for_gpus_s", 0)):
        if key in args:
            value = args[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < least:  # (a NaN wait_for_gpus_s turned the GPU wait off: NaN > 0 is false)
                raise ValueError(f"{key}: must be a number of seconds >= {least}, got {value!r}")
            extra[key] = float(value)
    return DeployArgs(config=cfg, **extra)


def config_from_args(args: Mapping[str, Any] | None) -> ServeConfig:
    """The ServeConfig the YAML `args:` describe (no Ray needed)."""
    return parse_args(args).config


def app(args: dict[str, Any]) -> serve.Application:
    """Ray Serve application builder: `import_path: deploy.pdserve_app:app`."""
    parsed = parse_args(args)
    _ensure_ray()
    if parsed.wait_for_gpus_s > 0:
        _wait_for_gpus(parsed.wait_for_gpus_s)
    # A colocated count left to the cluster is decided once, here: the workers and the
    # gateway (which finds them by name) must agree on it.
    parsed = dataclasses.replace(parsed, config=parsed.config.fit_to_cluster(cluster_gpus, node_gpus))
    _replace_workers(parsed)
    return gateway_app(parsed.config)


# -- Ray side -------------------------------------------------------------------------


def _ensure_ray(address: str | None = None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", address), namespace=NAMESPACE)


def _replace_workers(parsed: DeployArgs) -> None:
    """Kill the pdserve worker actors left by an earlier build, then start this config's."""
    stop_workers()
    start_workers(parsed.config, timeout_s=parsed.worker_timeout_s)


def _wait_for_gpus(timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.cluster_resources().get("GPU", 0) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"wait_for_gpus_s: no GPU joined the cluster within {timeout_s:.0f}s; the workers would run on CPU. "
                "Check `ray status` (GPU node types need min_workers >= 1) or set wait_for_gpus_s: 0.")
        time.sleep(5)


def stop_workers() -> list[str]:
    """Kill every pdserve worker actor in the pdserve namespace (any mode, any pool size)."""
    import ray
    from ray.util import list_named_actors

    killed = []
    for entry in list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE or not _WORKER_NAME.fullmatch(entry["name"]):
            continue
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
            killed.append(entry["name"])
        except ValueError:  # gone meanwhile
            pass
    # A name is free again only once the actor is dead; creating one sooner fails.
    deadline = time.monotonic() + 60
    while killed and time.monotonic() < deadline:
        alive = {e["name"] for e in list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE}
        if not alive.intersection(killed):
            break
        time.sleep(0.2)
    return killed


def _key(args: Mapping[str, Any], name: str) -> str | None:
    """A key (`api_key`, `metrics_api_key`) given inline, by environment variable or by file: at most one
    of the three forms, so a key kept out of the YAML is not overridden by one left in it."""
    forms = (name, f"{name}_env", f"{name}_file")
    given = [k for k in forms if args.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give only one of {', '.join(forms)}")
    if not given:
        return None
    key = given[0]
    value = args[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key}: must be a non-empty string, got {value!r}")
    if key == name:
        return value
    if key.endswith("_env"):
        secret = os.environ.get(value, "").strip()
        if not secret:
            raise ValueError(f"{key}: environment variable {value} is not set where the app is built")
        return secret
    path = os.path.expanduser(value)
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{key}: cannot read {path}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"{key}: {path} is empty")
    return secret


def _engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings under `engine_args:` (each may be given there or at the top level, not both)."""
    nested = args.get("engine_args")
    if nested is None:
        nested = {}
    if not isinstance(nested, Mapping):  # ([], 0, "" or false were taken for "none" without a word)
        raise ValueError(f"engine_args: must be a mapping, got {type(nested).__name__}")
    for key in nested:
        if key not in ENGINE_SETTINGS:
            raise ValueError(f"engine_args: unknown key {key!r} (known: {', '.join(sorted(ENGINE_SETTINGS))})")
    both = sorted(set(args) & set(nested))
    if both:
        raise ValueError(f"{both[0]}: given both at the top level and under engine_args")
    return dict(nested)


# -- `python -m deploy.pdserve_app stop deploy/serve.yaml` --------------------------


def _main(argv: list[str]) -> int:
    import yaml

    if len(argv) != 2 or argv[0] != "stop":
        print("usage: python -m deploy.pdserve_app stop SERVE_CONFIG.yaml", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    names = [a["name"] for a in doc.get("applications", []) if a.get("import_path", "").endswith("pdserve_app:app")]
    _ensure_ray("auto")  # the running cluster; never start a new one just to stop it
    for name in names:
        serve.delete(name)
        print(f"[pdserve] deleted Serve application {name!r}")
    print(f"[pdserve] killed workers: {', '.join(stop_workers()) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
