"""pdserve on a real two-node Ray cluster, on one machine.

The second Ray node runs inside a network namespace that this module creates: a veth
pair joins it to the machine on a /30 in 198.18.0.0/15 (the benchmarking range, RFC
2544: never routed), so the node has an address of its own and its own loopback. A
socket bound to 127.0.0.1 on one node cannot be reached from the other, as between two
hosts: when the data plane binds the wrong address, tokens stop after the first.

The head (198.18.x.1) runs the gateway and the prefill worker, the namespace node
(198.18.x.2) the decode worker, placed by `--prefill-resources` and friends; `kv_host`
is left to pdserve (auto-detected: Ray has two nodes) on the command line, and `auto`
through deploy/serve.yaml's shape. Greedy outputs must equal the offline engine's,
the decode worker's KV receiver must be on the namespace node's address, and the KV
must really have crossed (the prefill worker computed the prompts, the decode worker
did not).

What this does not cover: separate hosts (one kernel, one clock, a veth for the
network), GPUs, the NCCL transport across nodes. Needs root and `ip netns`
(skipped otherwise); everything it starts is stopped and removed whatever happens.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from factories import tiny_spec
from served import free_ports

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # ray, serve and pdserve of this environment


def _netns_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.netns,
              pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))]

PROMPTS = ["def add(a, b):\n    return a + b\n" * 3, "import sys\nimport os\n" * 5, "class Foo:\n    pass\n" * 4]
MAX_TOKENS = 12
START_S = 180  # a bound on every start: nodes, workers, gateway
# A node's Ray resources: the head takes the gateway and the prefill pool, the namespace node the decode pool.
HEAD_RESOURCES = {"gateway_node": 1, "prefill_node": 2}
NODE_RESOURCES = {"decode_node": 2}
POOLS = {"prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
         "gateway_resources": {"gateway_node": 1}}
ENGINE = {"max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 16}


@dataclass
class TwoNodes:
    address: str  # the head's GCS, host:port
    head_ip: str
    node_ip: str
    netns: str
    env: dict[str, str]  # for every process that joins the cluster
    run_dir: Path



def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def _names() -> tuple[str, str]:
    """The namespace and the host's veth end for one cluster. Random, not the pid: a run in
    another pid namespace on this network (a container on the host's) may have this pid."""
    tag = secrets.token_hex(4)
    return f"pdserve-mn-{tag}", f"pdmn{tag}h"  # 13 characters: a link name has 15 at most


def _subnet() -> tuple[str, str]:
    """A /30 of 198.18.0.0/15 that no address of this machine is in (another run's, a killed
    run's leftover), from a random start: two runs on one machine do not share one."""
    lines = _run("ip", "-4", "-o", "addr", "show").stdout.splitlines()
    used = {ipaddress.IPv4Interface(w[w.index("inet") + 1]).ip for w in map(str.split, lines) if "inet" in w}
    base, start = ipaddress.IPv4Address("198.18.0.0"), secrets.randbelow(2 ** 15)  # 2**15 /30s in the /15
    for k in range(2 ** 15):
        net = base + 4 * ((start + k) % 2 ** 15)
        if used.isdisjoint(net + i for i in range(4)):
            return str(net + 1), str(net + 2)
    pytest.skip("no /30 of 198.18.0.0/15 is free on this machine")


@contextlib.contextmanager
def _netns(name: str, veth: str, head_ip: str, node_ip: str) -> Iterator[None]:
    """A network namespace joined to this machine by a veth pair (head_ip here, node_ip there)."""
    peer = veth[:-1] + "n"
    try:
        _run("ip", "netns", "add", name)
    except subprocess.CalledProcessError as e:  # nothing made: the name, if it exists, is not this run's
        pytest.skip(f"cannot make a network namespace here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    try:
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", name)
        _run("ip", "addr", "add", f"{head_ip}/30", "dev", veth)
        _run("ip", "link", "set", veth, "up")
        _run("ip", "netns", "exec", name, "ip", "addr", "add", f"{node_ip}/30", "dev", peer)
        _run("ip", "netns", "exec", name, "ip", "link", "set", peer, "up")
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        _remove_netns(name, veth)
        pytest.skip(f"cannot make a network namespace here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    except BaseException:  # Ctrl-C, `ip` past its timeout, pytest-timeout's failure: nothing half-made stays
        _remove_netns(name, veth)
        raise
    try:
        yield
    finally:
        _remove_netns(name, veth)


def _remove_netns(name: str, veth: str) -> None:
    _run("ip", "netns", "del", name, check=False)  # takes its end of the pair, and so the pair, along
    if _run("ip", "link", "show", veth, check=False).returncode == 0:
        _run("ip", "link", "del", veth, check=False)


def _marked_pids(marker: str) -> list[int]:
    """Every process whose environment holds `marker`: the Ray nodes this module started,
    their workers (Ray renames them, but they inherit the environment), HAProxy, pdserve."""
    needle = marker.encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes():
                pids.append(int(entry))
    return pids


def _stop_marked(marker: str, grace_s: float = 5.0) -> None:
    """`ray stop` for this module's nodes only: SIGTERM, then SIGKILL what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _marked_pids(marker)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _marked_pids(marker)
        if not pids:
            return


def _ray_start(args: list[str], env: dict[str, str], log: Path, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    with open(log, "w") as out:
        proc = subprocess.run([*prefix, str(BIN / "ray"), "start", *args], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, timeout=START_S, start_new_session=True)
    assert proc.returncode == 0, f"ray start failed:\n{log.read_text()[-3000:]}"


@pytest.fixture()  # a cluster per test: nothing one test's Serve leaves (shutting down) can meet the next
def two_nodes() -> Iterator[TwoNodes]:
    head_ip, node_ip = _subnet()
    netns, veth = _names()
    marker = secrets.token_hex(8)
    run_dir = Path(tempfile.mkdtemp(prefix="pdmn", dir="/tmp"))  # short: Ray's socket paths live under it
    from pdserve.cluster.serve_app import HAPROXY_ENV, LOCAL_ENV, haproxy_env
    from pdserve.cluster.serve_config import ServeConfig
    from pdserve.workers.config import EngineConfig

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # HAProxy's own ports on the head, where other Ray instances may run: free ones, not Ray's defaults.
    metrics, stats, fallback, http = free_ports(4)
    haproxy = haproxy_env(ServeConfig(EngineConfig(model="-"), port=http, haproxy_metrics_port=metrics,
                                      haproxy_stats_port=stats, haproxy_fallback_port=fallback))
    env |= HAPROXY_ENV | LOCAL_ENV | haproxy | {
        "PDSERVE_MULTINODE_TEST": marker,
        # A cluster of its own: its token (Ray's token auth, as deploy/cluster.yaml runs it), never ~/.ray's.
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),  # deploy.pdserve_app
    }
    try:
        with _netns(netns, veth, head_ip, node_ip):
            gcs, dash, client, agent = free_ports(4)
            common = ["--temp-dir", "--object-store-memory", str(100 * 2 ** 20), "--disable-usage-stats"]
            _ray_start(["--head", "--node-ip-address", head_ip, "--port", str(gcs), "--num-cpus", "2",
                        "--resources", json.dumps(HEAD_RESOURCES), "--include-dashboard", "false",
                        "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
                        "--dashboard-agent-listen-port", str(agent), common[0], str(run_dir / "h"), *common[1:]],
                       env, run_dir / "head.log")
            address = f"{head_ip}:{gcs}"
            _ray_start(["--address", address, "--node-ip-address", node_ip, "--num-cpus", "1",
                        "--resources", json.dumps(NODE_RESOURCES), common[0], str(run_dir / "n"), *common[1:]],
                       env, run_dir / "node.log", netns=netns)
            yield TwoNodes(address, head_ip, node_ip, netns, env | {"RAY_ADDRESS": address}, run_dir)
    finally:
        _stop_marked(marker)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(haproxy["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"], ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[str]:
    offline = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)
    outs = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


PROBE = """
import json, ray
from ray._private import state
ray.init(namespace="pdserve", log_to_driver=False)
actors = {a["Name"]: a["Address"]["IPAddress"] for a in state.actors().values() if a["State"] == "ALIVE" and a["Name"]}
gateway = [ip for name, ip in actors.items() if "pdserve-gateway" in name]
prefill, decode = ray.get_actor("pdserve-prefill-0"), ray.get_actor("pdserve-decode-0")
print(json.dumps({
    "nodes": sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
    "prefill": actors.get("pdserve-prefill-0"), "decode": actors.get("pdserve-decode-0"), "gateway": gateway,
    "kv_address": ray.get(decode.info.remote()).kv_address,
    "tp": [ray.get(w.info.remote()).tensor_parallel_size for w in (prefill, decode)],
    "prefill_computed": ray.get(prefill.load.remote()).snapshot.prompt_tokens_computed,
    "decode_computed": ray.get(decode.load.remote()).snapshot.prompt_tokens_computed,
}))
"""


def _probe(nodes: TwoNodes) -> dict[str, Any]:
    """Where the cluster's actors run and what they did, asked of Ray by a driver of its own."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=nodes.env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# How often the start is polled: a 1 s poll found the server up 0.5 s late on average, per test.
READY_POLL_S = 0.25


def _wait_ready(url: str, alive: Callable[[], bool], log: Callable[[], str]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert alive(), f"the server exited while starting:\n{log()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(READY_POLL_S)
    raise AssertionError(f"no answer from {url} within {START_S} s:\n{log()}")


def _check_served(url: str, model: str, expected: list[str], nodes: TwoNodes, tp: tuple[int, int] = (1, 1)) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for prompt, want in zip(PROMPTS, expected):
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
    seen = _probe(nodes)
    assert seen["nodes"] == sorted([nodes.head_ip, nodes.node_ip])
    assert (seen["prefill"], seen["decode"], seen["gateway"]) == (nodes.head_ip, nodes.node_ip, [nodes.head_ip])
    # The decode worker's KV receiver listens on its node's address, which the prefill worker reached.
    assert seen["kv_address"].startswith(f"tcp://{nodes.node_ip}:")
    assert seen["prefill_computed"] > 60 and seen["decode_computed"] == 0, seen
    assert tuple(seen["tp"]) == tp  # (prefill, decode) ranks: the KV crossed re-sharded when they differ


def _log_tail(path: Path, nodes: TwoNodes) -> Callable[[], str]:
    def tail() -> str:
        serve_logs = sorted((nodes.run_dir / "h").glob("session_*/logs/serve/*.log"))
        extra = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in serve_logs[-3:])
        return path.read_text(errors="replace")[-4000:] + extra
    return tail


def test_pdserve_serve_puts_prefill_and_decode_on_two_nodes(two_nodes: TwoNodes, model_dir: Path,
                                                          expected: list[str]) -> None:
    """`pdserve serve` joining the cluster (RAY_ADDRESS), kv_host left to pdserve; the prefill
    worker runs two tensor-parallel ranks (`--prefill-tp 2`), the decode worker one: the KV
    crosses nodes as the whole model's heads, and greedy output equals the one-rank engine's."""
    port = free_ports(1)[0]
    args = [str(BIN / "pdserve"), "serve", "--model", str(model_dir), "--port", str(port), "--enforce-eager",
            "--prefill-tp", "2",
            *[a for name, value in POOLS.items() for a in (f"--{name.replace('_', '-')}", json.dumps(value))],
            *[a for name, value in ENGINE.items() for a in (f"--{name.replace('_', '-')}", str(value))]]
    log = two_nodes.run_dir / "pdserve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=two_nodes.env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, lambda: proc.poll() is None, _log_tail(log, two_nodes))
        _check_served(url, model_dir.name, expected, two_nodes, tp=(2, 1))
    finally:
        proc.send_signal(signal.SIGINT)  # pdserve serve stops its workers and Serve on Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_serve_yaml_puts_prefill_and_decode_on_two_nodes(two_nodes: TwoNodes, model_dir: Path,
                                                        expected: list[str]) -> None:
    """deploy/serve.yaml's application, its args made for the tiny model, through `serve run`
    (the builder runs in Serve's build task on the cluster)."""
    doc = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    port = free_ports(1)[0]
    doc["http_options"] |= {"host": "127.0.0.1", "port": port}
    args = doc["applications"][0]["args"]
    assert args["kv_host"] == "auto"  # the file's: each node's own address
    for name in ("api_key_file", "dtype", "gpu_memory_utilization", "max_num_batched_tokens"):
        args.pop(name, None)  # a GPU deployment's; the tiny model on CPU takes the defaults
    args |= {"model": str(model_dir), "prefill": 1, "decode": 1, "wait_for_gpus_s": 0, "worker_timeout_s": START_S,
             "enforce_eager": True, "block_size": 16, **ENGINE, **POOLS}
    config = two_nodes.run_dir / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))
    log = two_nodes.run_dir / "serve-run.log"
    with open(log, "w") as out:
        submitted = subprocess.run([str(BIN / "serve"), "run", "--non-blocking", str(config)], stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=two_nodes.env,
                                   cwd=ROOT, timeout=START_S, start_new_session=True)
    tail = _log_tail(log, two_nodes)
    assert submitted.returncode == 0, tail()
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, lambda: True, tail)
        _check_served(url, model_dir.name, expected, two_nodes)
    finally:
        subprocess.run([sys.executable, "-m", "deploy.pdserve_app", "stop", str(config)], capture_output=True,
                       env=two_nodes.env, cwd=ROOT, timeout=120)
