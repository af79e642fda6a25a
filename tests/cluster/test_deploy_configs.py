"""deploy/: the `ray up` config passes Ray's own autoscaler validator, the Serve config
passes Ray Serve's own schema, and its import path builds a valid ServeConfig.

No cloud, no Ray cluster, no network: the autoscaler checks are the schema-only steps
`ray up` runs before it talks to AWS (prepare_config, validate_config), and every
test runs with outbound connections refused.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import socket
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ray = pytest.importorskip("ray")

from ray._common.utils import import_attr  # noqa: E402  (what Serve itself uses for import_path)
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary  # noqa: E402
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema  # noqa: E402

from pdserve.cluster.serve_config import HAPROXY_PORTS, ServeConfig, serve_config  # noqa: E402
from pdserve.workers.config import DType, EngineConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"
SERVE_YAML = ROOT / "deploy" / "serve.yaml"

# A profile `pdserve profile` made (the planner settings load it where the cluster starts).
PLANNER_PROFILE = str(Path(__file__).resolve().parents[2] / "bench" / "results" / "profile_smollm2_2026-11-27.json")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any outbound connection (AWS, a registry, a Ray cluster) fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def deploy_pkg(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`deploy.pdserve_app`, imported the way Serve does: the repository root on sys.path."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("deploy.pdserve_app")


@pytest.fixture
def api_key_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A HOME with the key file that cluster.yaml copies to ~/.pdserve on every node."""
    (tmp_path / ".pdserve").mkdir()
    (tmp_path / ".pdserve" / "api_key").write_text("sk-test-0123456789\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    return "sk-test-0123456789"


def load(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict), f"{path} is not a YAML mapping"
    return doc


def prepared_cluster() -> dict[str, Any]:
    """What `ray up` validates: the file merged with the AWS defaults (no AWS call)."""
    return prepare_config(load(CLUSTER_YAML))


def pdserve_app_config() -> dict[str, Any]:
    (app,) = [a for a in load(SERVE_YAML)["applications"] if a["name"] == "pdserve"]
    return app


# -- deploy/cluster.yaml ------------------------------------------------------------------


def test_cluster_yaml_passes_the_ray_autoscaler_validator() -> None:
    config = prepared_cluster()
    validate_config(config)  # raises jsonschema.ValidationError / ValueError on a bad config
    assert config["provider"]["type"] == "aws"
    assert "boto3" not in sys.modules, "validation must not load the AWS provider"


@pytest.mark.parametrize("variable", ["RAY_worker_niceness", "RAY_SERVE_HAPROXY_METRICS_ENABLED"])
def test_every_node_starts_ray_as_local_ray_starts(variable: str) -> None:
    """Ray starts its workers (the engines, the gateway) at nice 15 unless told otherwise,
    behind its own daemons, and has HAProxy log every request for Serve's metrics: `pdserve
    serve` tells local Ray otherwise, and so must every node here."""
    from pdserve.cluster.serve_app import LOCAL_ENV

    config = prepared_cluster()
    expected = f"{variable}={LOCAL_ENV[variable]}"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in config[key] if "ray start" in c]
        assert expected in start.split(";")[1].split(), f"{key}: {expected} must be exported before ray start"


def _drop_provider(c: dict[str, Any]) -> None:
    del c["provider"]


def _gpu_count_as_text(c: dict[str, Any]) -> None:
    c["available_node_types"]["worker.gpu"]["resources"]["GPU"] = "four"


def _setup_command_parsed_as_mapping(c: dict[str, Any]) -> None:
    # What an unquoted `echo "pdserve: ..."` turns into in YAML.
    c["setup_commands"].append({'echo "pdserve': 'no weights"'})


def _unknown_head_type(c: dict[str, Any]) -> None:
    c["head_node_type"] = "head.gpu"


def _unknown_top_level_key(c: dict[str, Any]) -> None:
    c["max_worker"] = 3


def _min_workers_over_max(c: dict[str, Any]) -> None:
    c["available_node_types"]["worker.gpu"]["min_workers"] = 5


@pytest.mark.parametrize("breaks", [_drop_provider, _gpu_count_as_text, _setup_command_parsed_as_mapping,
                                    _unknown_head_type, _unknown_top_level_key, _min_workers_over_max])
def test_a_broken_cluster_yaml_fails_the_validator(breaks: Any) -> None:
    config = prepared_cluster()
    breaks(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_config(config)


def test_cluster_yaml_without_provider_cannot_even_be_prepared() -> None:
    raw = load(CLUSTER_YAML)
    del raw["provider"]
    with pytest.raises(KeyError):
        prepare_config(raw)


def test_cluster_has_a_cpu_head_and_enough_gpus_for_the_serve_config() -> None:
    config = prepared_cluster()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head runs the gateway, not a model"
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, "no GPU worker node type"
    args = pdserve_app_config()["args"]
    needed = args["prefill"] + args["decode"]  # one GPU per pdserve worker
    # Present before `serve run` (min_workers), since pdserve picks GPU workers only when the cluster has GPUs.
    ready = sum(t["resources"]["GPU"] * t["min_workers"] for t in gpu_types.values())
    assert ready >= needed, f"min_workers give {ready} GPUs, the Serve config needs {needed}"


def test_cluster_yaml_keeps_ray_private_and_secrets_out() -> None:
    text = CLUSTER_YAML.read_text()
    config = prepared_cluster()
    start = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    head_start = " ".join(config["head_start_ray_commands"])
    # The dashboard / Jobs API must not listen on the network (ShadowRay): Ray's AWS default is 0.0.0.0.
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "0.0.0.0" not in " ".join(start)
    # Serve imports deploy.pdserve_app from the checkout on every node, and every node runs
    # Ray with token auth (a node that joins by address does not turn it on by itself).
    for cmds in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert any('PYTHONPATH="$HOME/pdserve"' in c and "RAY_AUTH_MODE=token" in c and "ray start" in c
                   for c in cmds)
    assert "/home/ubuntu/.ray/auth_token" in config["file_mounts"]
    # Only the API port is opened beyond what Ray opens itself (SSH and intra-cluster).
    rules = config["provider"]["security_group"]["IpPermissions"]
    opened = {(r["FromPort"], r["ToPort"]) for r in rules}
    assert opened == {(load(SERVE_YAML)["http_options"]["port"],) * 2}
    for rule in rules:
        for rng in rule.get("IpRanges", []):
            assert rng["CidrIp"] != "0.0.0.0/0"
    assert "ssh_private_key" not in config["auth"]
    for pattern in (r"AKIA[0-9A-Z]{16}", r"aws_secret_access_key", r"hf_[A-Za-z0-9]{20,}", r"sk-[A-Za-z0-9]{16,}",
                    r"BEGIN [A-Z ]*PRIVATE KEY"):
        assert not re.search(pattern, text, re.IGNORECASE), pattern


def test_cluster_installs_torch_before_pdserve() -> None:
    config = prepared_cluster()
    for key in ("head_setup_commands", "worker_setup_commands"):
        cmds = config[key]
        torch_at = next(i for i, c in enumerate(cmds) if re.search(r"pip install .*torch==", c))
        pdserve_at = next(i for i, c in enumerate(cmds) if "pip install" in c and "-e ~/pdserve" in c)
        clone_at = next(i for i, c in enumerate(cmds) if "git clone" in c)
        assert clone_at < torch_at < pdserve_at, key
    worker_torch = next(c for c in config["worker_setup_commands"] if "torch==" in c)
    assert "whl/cpu" not in worker_torch, "GPU workers need the CUDA build of torch"


# -- deploy/serve.yaml ----------------------------------------------------------------------


def test_serve_yaml_passes_the_serve_deploy_schema() -> None:
    doc = load(SERVE_YAML)
    schema = ServeDeploySchema.model_validate(doc)  # the schema `serve run` / `serve deploy` apply to it
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    assert schema.proxy_location.value == "HeadOnly"
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("pdserve", "/", "deploy.pdserve_app:app")
    # A config with `applications:` is a deploy config, not a single-application one.
    with pytest.raises(Exception, match="import_path"):
        ServeApplicationSchema.model_validate(doc)


def test_serve_yaml_import_path_resolves_to_an_application_builder(deploy_pkg: Any) -> None:
    builder = import_attr(pdserve_app_config()["import_path"])
    assert callable(builder)
    assert builder is deploy_pkg.app
    assert len(inspect.signature(builder).parameters) == 1  # Serve's builder convention: one args dict


def test_serve_yaml_args_build_a_valid_serve_config(deploy_pkg: Any, api_key_home: str) -> None:
    args = pdserve_app_config()["args"]
    cfg = deploy_pkg.config_from_args(args)
    assert isinstance(cfg, ServeConfig)
    assert cfg.model == "/models/Meta-Llama-3-8B-Instruct"
    assert (cfg.mode, cfg.num_prefill, cfg.num_decode) == ("disaggregated", 2, 2)
    assert cfg.engine.max_model_len == 8192 and cfg.engine.block_size == 16
    assert cfg.api_key == api_key_home
    assert cfg.worker_names() == ["pdserve-prefill-0", "pdserve-prefill-1", "pdserve-decode-0", "pdserve-decode-1"]
    assert cfg.engine.dtype is DType.BFLOAT16 and cfg.engine.gpu_memory_utilization == 0.9
    parsed = deploy_pkg.parse_args(args)
    assert parsed.wait_for_gpus_s == 900 and parsed.worker_timeout_s == 900


def test_serve_yaml_holds_no_api_key() -> None:
    args = pdserve_app_config()["args"]
    assert "api_key" not in args and "api_key_file" in args


def test_builder_returns_the_gateway_application_under_serves_own_call(
        deploy_pkg: Any, api_key_home: str, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Any] = []
    monkeypatch.setattr(deploy_pkg, "_ensure_ray", lambda *a: None)
    monkeypatch.setattr(deploy_pkg, "_wait_for_gpus", lambda *a: None)
    monkeypatch.setattr(deploy_pkg, "_replace_workers", started.append)
    monkeypatch.setattr(deploy_pkg, "cluster_gpus", lambda: 8.0)  # what the YAML's cluster has
    app_cfg = pdserve_app_config()
    application = call_user_app_builder_with_args_if_necessary(import_attr(app_cfg["import_path"]), app_cfg["args"])
    assert isinstance(application, ray.serve.Application)
    (parsed,) = started
    assert parsed.config == deploy_pkg.config_from_args(app_cfg["args"]).fit_to_cluster(lambda: 8.0)


def test_bad_mode_raises_value_error_naming_mode(deploy_pkg: Any) -> None:
    with pytest.raises(ValueError, match=r"^mode\b"):
        deploy_pkg.config_from_args({"model": "/models/m", "mode": "sideways"})


def test_bad_mode_fails_before_any_ray_call(deploy_pkg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*a: Any) -> None:
        raise AssertionError("Ray touched before the args were validated")

    monkeypatch.setattr(deploy_pkg, "_ensure_ray", must_not_run)
    monkeypatch.setattr(deploy_pkg, "_replace_workers", must_not_run)
    with pytest.raises(ValueError, match=r"^mode\b"):
        deploy_pkg.app({"model": "/models/m", "mode": "sideways"})


@pytest.mark.parametrize("args, field", [
    ({}, "model"),
    ({"model": ""}, "model"),
    ({"model": "/m", "prefill": 0}, "prefill"),
    ({"model": "/m", "decode": "2"}, "decode"),
    ({"model": "/m", "workers": 2}, "workers"),  # disaggregated: prefill and decode
    ({"model": "/m", "mode": "colocated", "workers": 0}, "workers"),
    ({"model": "/m", "mode": "colocated", "prefill": 2}, "prefill"),  # colocated: workers
    ({"model": "/m", "prefill": True}, "prefill"),
    ({"model": "/m", "max_model_len": -1}, "max_model_len"),
    ({"model": "/m", "block_size": 24}, "block_size"),
    ({"model": "/m", "dtype": "fp8"}, "dtype"),
    ({"model": "/m", "engine_args": {"dtype": "fp8"}}, "dtype"),
    ({"model": "/m", "engine_args": {"record_kv_events": True}}, "engine_args"),
    ({"model": "/m", "dtype": "float16", "engine_args": {"dtype": "bfloat16"}}, "dtype"),
    ({"model": "/m", "transport": "carrier-pigeon"}, "transport"),
    ({"model": "/m", "modle": "/m"}, "modle"),
    ({"model": "/m", "host": "0.0.0.0"}, "host"),
    ({"model": "/m", "port": 8000}, "port"),
    ({"model": "/m", "haproxy_metrics_port": 9200}, "haproxy_metrics_port"),
    ({"model": "/m", "haproxy_stats_port": 8500}, "haproxy_stats_port"),
    ({"model": "/m", "haproxy_fallback_port": 8600}, "haproxy_fallback_port"),
    # Settings `pdserve serve` applies to the local Ray and HAProxy it starts: ignored under Serve.
    ({"model": "/m", "max_connections_per_client": 4}, "max_connections_per_client"),
    ({"model": "/m", "max_connections": 100}, "max_connections"),
    ({"model": "/m", "header_timeout": 5}, "header_timeout"),
    ({"model": "/m", "keep_alive_timeout": 5}, "keep_alive_timeout"),
    ({"model": "/m", "ingress": "proxy"}, "ingress"),
    ({"model": "/m", "cpu_pinning": "off"}, "cpu_pinning"),
    ({"model": "/m", "control_plane_nice": 10}, "control_plane_nice"),
    ({"model": "/m", "api_key": "k", "api_key_env": "PDSERVE_API_KEY"}, "api_key_env"),
    ({"model": "/m", "api_key_env": "PDSERVE_TEST_UNSET_VARIABLE"}, "api_key_env"),
    ({"model": "/m", "api_key_file": "/nonexistent/pdserve/api_key"}, "api_key_file"),
    ({"model": "/m", "metrics_api_key": "k", "metrics_api_key_file": "/k"}, "metrics_api_key_file"),
    ({"model": "/m", "metrics_api_key_env": "PDSERVE_TEST_UNSET_VARIABLE"}, "metrics_api_key_env"),
    ({"model": "/m", "wait_for_gpus_s": -5}, "wait_for_gpus_s"),
    ({"model": "/m", "worker_timeout_s": 0}, "worker_timeout_s"),
    ({"model": "/m", "request_timeout": 0}, "request_timeout"),
    ({"model": "/m", "prefill_timeout": "soon"}, "prefill_timeout"),
    ({"model": "/m", "worker_wait": -1}, "worker_wait"),
    ({"model": "/m", "served_model_name": []}, "served_model_name"),
    ({"model": "/m", "worker_wait": float("inf")}, "worker_wait"),
    ({"model": "/m", "autoscale_roles": True}, "planner_profile"),
    ({"model": "/m", "slo": ["ttft:500"]}, "planner_profile"),
    ({"model": "/m", "planner_profile": "/nonexistent/profile.json", "slo": ["ttft:500"]}, "planner_profile"),
    ({"model": "/m", "planner_profile": PLANNER_PROFILE}, "slo"),
    ({"model": "/m", "planner_profile": PLANNER_PROFILE, "slo": ["ttfx:5"]}, "slo"),
    ({"model": "/m", "planner_profile": PLANNER_PROFILE, "slo": "ttft:500", "planner_interval": 0}, "planner_interval"),
    ({"model": "/m", "planner_profile": PLANNER_PROFILE, "slo": "ttft:500", "mode": "colocated"}, "planner_profile"),
    ({"model": "/m", "autoscale_roles": "yes"}, "autoscale_roles"),
])
def test_bad_args_raise_value_error_naming_the_arg(deploy_pkg: Any, args: dict[str, Any], field: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        deploy_pkg.config_from_args(args)


def test_a_profile_timed_in_another_dtype_than_the_workers_compute_in_is_refused(
        deploy_pkg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The saved profile is float32 on CPU: bfloat16 workers (given, or `auto` on a CPU with
    native bfloat16) would run every step at another speed than the planner predicts."""
    planned = {"model": "/m", "planner_profile": PLANNER_PROFILE, "slo": ["ttft:500"]}
    with pytest.raises(ValueError, match=r"^planner_profile: .*float32.*bfloat16"):
        deploy_pkg.config_from_args({**planned, "dtype": "bfloat16"})
    monkeypatch.delenv("PDSERVE_DTYPE")  # the suite pins float32; `auto` is what users get
    for native, ok in ((True, False), (False, True)):
        monkeypatch.setattr("pdserve.workers.cpu_features.has_native_bf16", lambda native=native: native)
        if ok:
            assert deploy_pkg.config_from_args(planned).planner is not None
        else:
            with pytest.raises(ValueError, match=r"^planner_profile: .*--dtype float32"):
                deploy_pkg.config_from_args(planned)
    assert deploy_pkg.config_from_args({**planned, "dtype": "float32"}).planner is not None


def test_the_planner_settings_become_the_gateway_s_planner(deploy_pkg: Any) -> None:
    cfg = deploy_pkg.config_from_args({"model": "/m", "prefill": 1, "decode": 2, "planner_profile": PLANNER_PROFILE,
                                       "slo": ["ttft:500", "tpot:50"], "planner_interval": 15,
                                       "autoscale_roles": True})
    assert cfg.planner.slo.ttft == 0.5 and cfg.planner.slo.tpot == 0.05
    assert cfg.planner.interval_s == 15 and cfg.planner.apply
    assert cfg.planner.profile.model["name"] == "SmolLM2-135M-Instruct"
    assert serve_config({"model": "/m"}).planner is None


def test_api_key_from_the_environment(deploy_pkg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_TEST_KEY", "  secret-from-env\n")
    cfg = deploy_pkg.config_from_args({"model": "/m", "api_key_env": "PDSERVE_TEST_KEY"})
    assert cfg.api_key == "secret-from-env"


def test_metrics_key_from_a_file_apart_from_the_api_key(deploy_pkg: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "metrics_key").write_text("scraper-key\n")
    monkeypatch.setenv("PDSERVE_TEST_KEY", "client-key")
    cfg = deploy_pkg.config_from_args({"model": "/m", "api_key_env": "PDSERVE_TEST_KEY",
                                       "metrics_api_key_file": str(tmp_path / "metrics_key")})
    assert (cfg.api_key, cfg.metrics_api_key) == ("client-key", "scraper-key")
    assert "scraper-key" not in repr(cfg) and "client-key" not in repr(cfg)


def test_colocated_worker_count_is_given_or_fits_the_cluster(deploy_pkg: Any) -> None:
    given = serve_config({"model": "/m", "mode": "colocated", "workers": 3, "gateway_replicas": 1})
    assert given.fit_to_cluster(lambda: pytest.fail("the cluster is not asked")) is given
    left = deploy_pkg.config_from_args({"model": "/m", "mode": "colocated"})
    assert left.num_colocated is None
    with pytest.raises(ValueError, match="^workers"):
        left.worker_names()  # nothing may start before the count is decided
    assert left.fit_to_cluster(lambda: 0).worker_names() == ["pdserve-worker-0"]  # CPU: one on every core
    assert left.fit_to_cluster(lambda: 4.0).worker_names() == [f"pdserve-worker-{i}" for i in range(4)]
    disagg = serve_config({"model": "/m", "gateway_replicas": 2})
    assert disagg.fit_to_cluster(lambda: pytest.fail("the cluster is not asked")) is disagg


@pytest.mark.parametrize(("settings", "gpus", "replicas"), [
    ({"mode": "colocated"}, 0, 1),  # a CPU machine: one
    ({"mode": "colocated"}, 4, 1),  # four GPU workers per replica
    ({"mode": "colocated"}, 8, 2),
    ({"mode": "colocated"}, 9, 3),
    ({"prefill": 3, "decode": 5}, 8, 2),
    ({"prefill": 3, "decode": 5}, 2, 1),  # workers beyond the GPUs are CPU ones
    ({"prefill": 3, "decode": 5}, 0, 1),
    ({"mode": "colocated", "max_in_flight": 2}, 64, 2),  # each replica admits one at least
])
def test_gateway_replicas_left_to_the_cluster_are_one_per_four_gpu_workers(
        settings: dict[str, Any], gpus: float, replicas: int) -> None:
    assert serve_config({"model": "/m", **settings}).fit_to_cluster(lambda: gpus).gateway_replicas == replicas


@pytest.mark.parametrize(("max_in_flight", "replicas"), [(256, 1), (256, 3), (7, 7), (10, 4)])
def test_replicas_admit_max_in_flight_in_all(max_in_flight: int, replicas: int) -> None:
    cfg = serve_config({"model": "/m", "max_in_flight": max_in_flight, "gateway_replicas": replicas})
    shares = [cfg.admission_share(r) for r in range(replicas)]
    assert sum(shares) == max_in_flight and max(shares) - min(shares) <= 1 and min(shares) >= 1
    with pytest.raises(ValueError, match="^rank"):
        cfg.admission_share(replicas)


def test_more_replicas_than_max_in_flight_is_refused() -> None:
    with pytest.raises(ValueError, match="^gateway_replicas"):
        serve_config({"model": "/m", "max_in_flight": 2, "gateway_replicas": 3})


def test_minimal_args_take_serve_config_defaults(deploy_pkg: Any) -> None:
    cfg = deploy_pkg.config_from_args({"model": "/m"})
    # (Settings that name no HAProxy port leave all three to pdserve: ServeConfig built directly, none.)
    assert cfg == serve_config({"model": "/m"}) == ServeConfig(EngineConfig("/m"), haproxy_ports_auto=frozenset(
        HAPROXY_PORTS))
    assert deploy_pkg.parse_args({"model": "/m"}).wait_for_gpus_s == 0  # CPU-only runs stay possible


@pytest.mark.parametrize("sizes", [{"mode": "colocated", "workers": 5}, {"prefill": 3, "decode": 2}])
def test_stop_matches_exactly_the_worker_names_start_makes(deploy_pkg: Any, sizes: dict[str, Any]) -> None:
    cfg = serve_config({"model": "/m", **sizes})
    assert len(cfg.worker_names()) == 5
    assert all(deploy_pkg._WORKER_NAME.fullmatch(n) for n in cfg.worker_names())
    for other in ("pdserve-gateway", "pdserve-router", "SERVE_CONTROLLER_ACTOR", "pdserve-decode-x"):
        assert not deploy_pkg._WORKER_NAME.fullmatch(other)


def test_broken_serve_yaml_fails_the_schema() -> None:
    doc = load(SERVE_YAML)
    bad = copy.deepcopy(doc)
    bad["applications"][0]["import_path"] = "pdserve_app"  # no module:attr
    with pytest.raises(Exception, match="import_path"):
        ServeDeploySchema.model_validate(bad)
    bad = copy.deepcopy(doc)
    bad["http_options"]["port"] = "eight thousand"
    with pytest.raises(Exception, match="port"):
        ServeDeploySchema.model_validate(bad)


def test_the_command_line_and_the_yaml_make_the_same_config(deploy_pkg: Any) -> None:
    """One mapping: `pdserve serve`'s flags and the Serve YAML's args, by the same names."""
    from pdserve.cluster.cli import build_parser, settings_from_flags

    argv = ["serve", "--model", "/m", "--prefill", "2", "--max-model-len", "2048", "--dtype", "bfloat16",
            "--kv-failure-policy", "fail", "--request-timeout", "120", "--prefill-timeout", "10",
            "--no-prefix-caching", "--load-poll-interval", "0.5", "--max-prefill-backlog-tokens", "0",
            "--stream-interval", "8", "--prefill-tp", "2", "--exclude-tools-when-tool-choice-none"]
    from_flags = serve_config(settings_from_flags(build_parser().parse_args(argv)))
    from_yaml = deploy_pkg.config_from_args({"model": "/m", "prefill": 2, "max_model_len": 2048, "dtype": "bfloat16",
                                             "kv_failure_policy": "fail", "request_timeout": 120,
                                             "prefill_timeout": 10, "enable_prefix_caching": False,
                                             "load_poll_interval": 0.5, "max_prefill_backlog_tokens": 0,
                                             "stream_interval": 8, "prefill_tp": 2,
                                             "exclude_tools_when_tool_choice_none": True})
    assert from_flags == from_yaml and from_flags.load_poll_interval == 0.5 and from_flags.stream_interval == 8
    assert (from_flags.pool_tp("prefill"), from_flags.pool_tp("decode")) == (2, 1)
    assert from_flags.max_prefill_backlog_tokens == 0 and from_flags.exclude_tools_when_tool_choice_none
    assert from_flags.engine.max_model_len == 2048 and not from_flags.engine.enable_prefix_caching
    assert from_flags.prefill_timeout == 10 and from_flags.kv_failure_policy.value == "fail"


def test_the_prefill_timeout_flag_says_none_as_the_yaml_says_null(deploy_pkg: Any) -> None:
    """`prefill_timeout: null` in the YAML leaves a remote prefill to the request's deadline;
    the flag said only numbers, so a command line could not ask for what the YAML can."""
    from pdserve.cluster.cli import build_parser, settings_from_flags

    argv = ["serve", "--model", "/m", "--prefill-timeout", "none"]
    from_flags = serve_config(settings_from_flags(build_parser().parse_args(argv)))
    from_yaml = deploy_pkg.config_from_args({"model": "/m", "prefill_timeout": None})
    assert from_flags.prefill_timeout is None and from_flags == from_yaml
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "/m", "--prefill-timeout", "soon"])


@pytest.mark.parametrize("interval", [0, -1, 61, float("nan"), True, "fast"])
def test_a_load_poll_interval_out_of_range_is_refused(interval: Any) -> None:
    with pytest.raises(ValueError, match="load_poll_interval"):
        ServeConfig(EngineConfig("/m"), load_poll_interval=interval)


@pytest.mark.parametrize("interval", [0, -3, 2.5, "many"])
def test_a_stream_interval_below_one_or_not_whole_is_refused(interval: Any) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        ServeConfig(EngineConfig("/m"), stream_interval=interval)


def test_the_prefill_backlog_is_on_for_cpu_clusters_off_on_gpus_unless_given() -> None:
    default = ServeConfig(EngineConfig("/m"))
    assert default.prefill_backlog_tokens(gpus=0) == 1024 and default.prefill_backlog_tokens(gpus=8) == 0
    given = ServeConfig(EngineConfig("/m"), max_prefill_backlog_tokens=4096)
    assert given.prefill_backlog_tokens(gpus=0) == given.prefill_backlog_tokens(gpus=8) == 4096


def test_cpu_workers_on_a_gpu_cluster_get_the_cpu_prefill_backlog() -> None:
    """`--device cpu` workers hold no GPU (cluster/placement.py): their prefill steps are a CPU's,
    which the 1024-token backlog was measured for; a GPU cluster's default (off) is not theirs."""
    cpu = ServeConfig(EngineConfig("/m", device="cpu"))
    assert cpu.prefill_backlog_tokens(gpus=8) == cpu.prefill_backlog_tokens(gpus=0) == 1024


@pytest.mark.parametrize("backlog", [-1, 1.5, True, "many"])
def test_a_prefill_backlog_that_is_not_a_count_of_tokens_is_refused(backlog: Any) -> None:
    with pytest.raises(ValueError, match="max_prefill_backlog_tokens"):
        ServeConfig(EngineConfig("/m"), max_prefill_backlog_tokens=backlog)


def test_served_model_name_from_the_command_line_and_the_yaml(deploy_pkg: Any) -> None:
    """vLLM's --served-model-name NAME [NAME ...]; the YAML takes a list or one name."""
    from pdserve.cluster.cli import build_parser, settings_from_flags

    argv = ["serve", "--model", "/models/llama/", "--served-model-name", "llama", "org/llama"]
    from_flags = serve_config(settings_from_flags(build_parser().parse_args(argv)))
    yaml_args = {"model": "/models/llama/", "served_model_name": ["llama", "org/llama"]}
    assert from_flags == deploy_pkg.config_from_args(yaml_args)
    assert from_flags.served_names == ("llama", "org/llama")
    one = deploy_pkg.config_from_args({"model": "/models/llama/", "served_model_name": "llama"})
    assert one.served_names == ("llama",)
    # Not given: the model argument as given, then its basename.
    assert deploy_pkg.config_from_args({"model": "/models/llama/"}).served_names == ("/models/llama/", "llama")


def test_every_engine_setting_the_yaml_takes_is_a_flag_of_pdserve_serve() -> None:
    """One set of settings for the command line and a Serve YAML (docs/cluster.md): each engine
    setting a user sets has its flag, by the same name (`--gpu-memory-utilization` and
    `--kv-cache-memory` were the YAML's only)."""
    from pdserve.cluster.cli import build_parser
    from pdserve.cluster.serve_config import ENGINE_SETTINGS

    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
                 if any(o.dest == "stall_timeout" for o in a._actions))
    dests = {o.dest for o in serve._actions}
    assert ENGINE_SETTINGS - dests == set()


@pytest.mark.parametrize(("setting", "value"), [
    ("router_policy", "round_robin"), ("kv_failure_policy", "fail"), ("transport", "nccl"),
    ("prefill_timeout", 5.0), ("transfer_timeout", 5.0), ("max_prefill_backlog_tokens", 5),
    ("load_poll_interval", 5.0),
])
def test_a_colocated_cluster_refuses_the_disaggregated_pools_settings(setting: str, value: object) -> None:
    """Accepted without a word, and read by nothing: the operator believed them in force."""
    with pytest.raises(ValueError, match=setting):
        serve_config({"model": "tiny", "mode": "colocated", "stall_timeout": 0, setting: value})


def test_a_colocated_clusters_short_stall_timeout_is_not_held_to_the_load_polls() -> None:
    """Colocated workers are polled every stall_timeout / 10, not every load_poll_interval:
    0.5 s was refused for the disaggregated polls it does not have."""
    assert serve_config({"model": "tiny", "mode": "colocated", "stall_timeout": 0.5}).stall_timeout == 0.5


@pytest.mark.parametrize("args", [
    {"worker_timeout_s": float("nan")}, {"worker_timeout_s": float("inf")},
    {"wait_for_gpus_s": float("nan")}, {"wait_for_gpus_s": float("inf")},  # NaN turned the GPU wait off
    {"engine_args": []}, {"engine_args": 0}, {"engine_args": ""}, {"engine_args": False},
], ids=lambda a: f"{next(iter(a))}={next(iter(a.values()))!r}")
def test_serve_yaml_builder_args_out_of_range_are_refused_by_name(deploy_pkg: Any, args: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(args))):
        deploy_pkg.parse_args({"model": "tiny", **args})


def test_the_model_may_sit_under_engine_args_as_every_engine_setting(deploy_pkg: Any) -> None:
    assert deploy_pkg.parse_args({"engine_args": {"model": "tiny", "max_model_len": 256}}).config.model == "tiny"


@pytest.mark.parametrize("settings", [{"device": ""}, {"device": "gpu"}, {"device": "cuda:x"}, {"tokenizer": ""},
                                      {"speculative": "draft", "draft_model": " "}, {"model": " "}])
def test_engine_strings_that_name_nothing_are_refused_by_name(settings: dict[str, str]) -> None:
    """They passed the config and failed later in a worker (a RuntimeError after Ray was up), or
    were taken for "unset" (an empty tokenizer)."""
    name = "draft_model" if "draft_model" in settings else next(iter(settings))
    with pytest.raises(ValueError, match=name):
        serve_config({"model": "tiny", **settings})
