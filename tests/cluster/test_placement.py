"""Where things run (cluster/placement.py), without Ray: the data plane's address
(`--kv-host`), the pools' Ray resources, and the GPU decision. tests/cluster/test_multinode.py
runs them on a real two-node Ray cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from factories import serve_in_process

from pdserve.cluster import cli, placement, serve_app
from pdserve.cluster.serve_config import serve_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", [None, "auto", "127.0.0.1", "10.0.3.7"])
def test_kv_host_takes_auto_or_an_ipv4_address(value: str | None) -> None:
    settings = {"model": "/m"} | ({} if value is None else {"kv_host": value})
    assert serve_config(settings).kv_host == value


@pytest.mark.parametrize(("value", "says"), [
    ("localhost", "a host name is not resolved"),
    ("node-1.internal", "a host name is not resolved"),
    ("0.0.0.0", "no address a peer can connect to"),
    ("::1", "IPv6"),
    ("", "must be auto"),
    (5, "must be auto"),
])
def test_kv_host_refuses_what_a_peer_could_not_connect_to(value: Any, says: str) -> None:
    with pytest.raises(ValueError, match=r"^kv_host: ") as e:
        serve_config({"model": "/m", "kv_host": value})
    assert says in str(e.value)


def test_an_unknown_kv_bind_host_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^kv_bind_host: unknown setting .*kv_host"):
        serve_config({"model": "/m", "kv_bind_host": "auto"})


def test_kv_host_flag_reaches_the_config_and_a_bad_one_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[Any] = []
    serve_in_process(monkeypatch)
    monkeypatch.setattr(serve_app, "run", ran.append)
    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: False)  # a joined cluster: its nodes have the model
    assert cli.main(["serve", "--model", "/nonexistent/m", "--kv-host", "auto",
                     "--decode-resources", '{"decode_node": 1}']) == 0
    assert ran[0].kv_host == "auto" and ran[0].decode_resources == {"decode_node": 1.0}
    assert cli.main(["serve", "--model", "/nonexistent/m", "--kv-host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: kv_host: 0.0.0.0 listens on every interface")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", "/nonexistent/m", "--prefill-resources", "{prefill_node: 1}"])
    assert e.value.code == 2 and "--prefill-resources: not JSON" in capsys.readouterr().err


def test_serve_yaml_binds_each_nodes_own_address() -> None:
    (app,) = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())["applications"]
    assert app["args"]["kv_host"] == "auto"


def test_the_default_is_loopback_without_ray_and_each_nodes_address_on_several(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    assert not ray.is_initialized()
    assert placement.bind_host(None) == "127.0.0.1"
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.3.7")
    assert placement.bind_host("auto") == "10.0.3.7"  # auto: this node's address, one node or several
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert placement.bind_host(None) == "127.0.0.1"  # one live node
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert placement.bind_host(None) == "10.0.3.7"
    assert placement.bind_host("127.0.0.1") == "127.0.0.1"  # given: as given


def test_an_address_that_is_not_this_nodes_fails_naming_kv_host() -> None:
    with pytest.raises(ValueError, match=r"^kv_host: 198\.51\.100\.7 is not an address of the node"):
        placement.bind_host("198.51.100.7")  # TEST-NET-2: on no machine


@pytest.mark.parametrize(("settings", "says"), [
    ({"prefill_resources": {}}, "non-empty mapping"),
    ({"prefill_resources": ["prefill_node"]}, "non-empty mapping"),
    ({"decode_resources": {"GPU": 1}}, "Ray's own resource"),
    ({"decode_resources": {"CPU": 0.5}}, "Ray's own resource"),
    ({"decode_resources": {"decode_node": 0}}, "must be a number > 0"),
    ({"decode_resources": {"decode_node": True}}, "must be a number > 0"),
    # Ray refuses it only when the actor is made, Ray up, in words that name no setting.
    ({"decode_resources": {"decode_node": 0.00001}}, "0.0001 at least"),
    ({"gateway_resources": {"head": 5e-5}}, "0.0001 at least"),
    ({"gateway_resources": {"head": 1.5}}, "whole number"),
    ({"gateway_resources": {"": 1}}, "non-empty strings"),
    ({"worker_resources": {"gpu_node": 1}}, "colocated mode only"),
    ({"mode": "colocated", "prefill_resources": {"gpu_node": 1}}, "disaggregated mode only"),
])
def test_pool_resources_are_checked_by_name(settings: dict[str, Any], says: str) -> None:
    name = next(k for k in settings if k.endswith("_resources"))
    with pytest.raises(ValueError, match=rf"^{name}: ") as e:
        serve_config({"model": "/m", **settings})
    assert says in str(e.value)


def test_pool_resources_become_actor_options() -> None:
    cfg = serve_config({"model": "/m", "prefill_resources": {"prefill_node": 1}, "gateway_resources": {"head": 0.5}})
    assert cfg.prefill_resources == {"prefill_node": 1.0} and cfg.decode_resources is None
    share = placement.worker_share("auto", cfg.num_workers, {"CPU": 8.0})
    assert placement.with_resources(share.options, cfg.prefill_resources) == {
        "num_cpus": 1.0, "resources": {"prefill_node": 1.0}}
    assert placement.with_resources(share.options, cfg.decode_resources) == {"num_cpus": 1.0}


@pytest.mark.parametrize(("device", "cluster", "options", "threads"), [
    ("auto", {"CPU": 64.0, "GPU": 8.0}, {"num_gpus": 1}, 1),
    ("cuda", {"CPU": 64.0, "GPU": 8.0}, {"num_gpus": 1}, 1),
    ("cuda:0", {"CPU": 64.0, "GPU": 8.0}, {"num_gpus": 1}, 1),
    ("auto", {"CPU": 4.0}, {"num_cpus": 1.0}, 2),
    ("cpu", {"CPU": 4.0, "GPU": 8.0}, {"num_cpus": 1.0}, 2),  # asked for CPU: no GPU held idle
    ("auto", {"CPU": 1.0}, {"num_cpus": 0.01}, 1),
])
def test_each_worker_takes_one_gpu_on_a_gpu_cluster_else_a_cpu_share(
        device: str, cluster: dict[str, float], options: dict[str, Any], threads: int) -> None:
    share = placement.worker_share(device, 2, cluster)
    assert (share.options, share.threads) == (options, threads)


@pytest.mark.parametrize(("cpus", "workers", "sharing", "threads", "split_threads"), [
    (2, 1, placement.CpuSharing.SPLIT, 1, 0),  # one worker on a core, the gateway on the other (vLLM's layout)
    (16, 1, placement.CpuSharing.SPLIT, 15, 0),
    (1, 1, placement.CpuSharing.SPLIT, 1, 0),  # nothing to leave: the one core is the worker's too
    (2, 2, placement.CpuSharing.SPLIT, 1, 0),  # a thread each at least
    (4, 1, placement.CpuSharing.TURNS, 4, 0),  # turns take every core
    # Lending keeps the whole share; a model under the floor steps on the split one.
    (2, 1, placement.CpuSharing.AUTO, 2, 1),
    (16, 2, placement.CpuSharing.AUTO, 8, 7),
    (4, 2, placement.CpuSharing.LEND, 2, 1),
])
def test_a_colocated_share_leaves_the_serving_plane_a_core(
        cpus: int, workers: int, sharing: placement.CpuSharing, threads: int, split_threads: int) -> None:
    share = placement.worker_share("cpu", workers, {"CPU": float(cpus)}, sharing,
                                   plane_cores=placement.COLOCATED_PLANE_CORES)
    assert (share.threads, share.split_threads) == (threads, split_threads)
    before = placement.worker_share("cpu", workers, {"CPU": float(cpus)}, sharing)  # disaggregated: as before
    assert before.threads == (cpus if sharing is placement.CpuSharing.TURNS else max(1, cpus // workers))
    assert before.split_threads in (0, before.threads)
    assert placement.worker_share("auto", workers, {"CPU": float(cpus), "GPU": 2.0},
                                  plane_cores=placement.COLOCATED_PLANE_CORES).options == {"num_gpus": 1}


@pytest.mark.parametrize(("device", "says"), [
    ("cuda", "device: cuda, but the Ray cluster has no GPU"),
    ("cuda:1", "device: cuda:1 names one GPU of a machine"),
])
def test_a_cuda_device_without_a_gpu_in_the_cluster_is_an_error(device: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"^{says}"):
        placement.worker_share(device, 2, {"CPU": 16.0})


def test_pdserve_serve_with_cuda_on_a_cpu_cluster_fails_before_any_worker_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster is Ray's answer (`ray.cluster_resources()` of a CPU-only cluster): `pdserve serve
    --device cuda` exits 2 with the reason, and no worker actor is made."""
    from pdserve.cluster import ray_actors

    def no_actor(*a: Any, **k: Any) -> None:
        raise AssertionError("a worker actor was made")

    serve_in_process(monkeypatch)
    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: False)
    monkeypatch.setattr(serve_app, "init_ray", lambda cfg: None)
    monkeypatch.setattr(serve_app.ray, "cluster_resources", lambda: {"CPU": 16.0, "memory": 1e10})
    for name in ("PrefillWorkerActor", "DecodeWorkerActor", "EngineWorkerActor"):
        monkeypatch.setattr(ray_actors, name, type(name, (), {"options": staticmethod(no_actor)}))
    code = cli.main(["serve", "--model", "/nonexistent/m", "--device", "cuda"])
    assert code == 2
    assert capsys.readouterr().err.startswith("pdserve: error: device: cuda, but the Ray cluster has no GPU")


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_cpu_workers_on_a_gpu_cluster_are_counted_as_cpu_workers(mode: str) -> None:
    """`--device cpu` never holds a GPU (`worker_share`), so the counts left to the cluster
    follow a CPU cluster's: one colocated worker on the node's cores (not one per GPU: eight CPU
    workers splitting the cores, none with a GPU), and one gateway replica (not one per four GPU
    workers there are none of)."""
    cfg = serve_config({"model": "/m", "mode": mode, "device": "cpu"}).fit_to_cluster(lambda: 8.0)
    cpu = serve_config({"model": "/m", "mode": mode, "device": "cpu"}).fit_to_cluster(lambda: 0.0)
    assert (cfg.num_workers, cfg.gateway_replicas) == (cpu.num_workers, cpu.gateway_replicas)
    assert cfg.gateway_replicas == 1
    assert placement.worker_share("cpu", cfg.num_workers, {"CPU": 64.0, "GPU": 8.0}).options.get("num_gpus") is None
