"""Where things run on a Ray cluster of one node or several: the data plane's address
(`kv_host`), the nodes each pool may use (`*_resources`), and what a worker actor asks Ray for.

**`kv_host`.** Every socket that carries KV or tokens between pdserve processes binds
this address on the node where it is made and advertises it to its peers: a decode
worker's KV receiver (with the NCCL transport, the same ZeroMQ socket is the pair's
rendezvous store; the gloo/NCCL ranks then connect over the route between the two
nodes) and the gateway's token stream, which workers push tokens to. Prefill workers
and the token-stream publishers only connect. The setting is one of:

- unset (None, the default): this node's Ray address when the Ray cluster has more
  than one node when the socket is made, else 127.0.0.1;
- `auto`: this node's Ray address (`ray.util.get_node_ip_address()`), always;
- an IPv4 address of the node: that address (so, in practice, a one-node cluster).

It is resolved where the socket is made (`bind_host`), so each node binds its own
address. A data-plane socket on a routable address is reachable by every host on that
network: keep the nodes on a private one (docs/security-data-plane.md).

**Pool resources.** `prefill_resources`, `decode_resources`, `worker_resources`
(colocated workers) and `gateway_resources` name Ray custom resources that each actor
of that pool requires, for example `{"prefill_node": 1}` with a node started as
`ray start --resources '{"prefill_node": 8}'`: that is how a pool is put on
particular nodes (an autoscaler starts a node type that offers the resource). The
amounts count per actor, as Ray's do.

**GPUs.** On a cluster with a GPU, each worker actor requires one a tensor-parallel rank (Ray
sets its `CUDA_VISIBLE_DEVICES`; the engine's `cuda` is the first, rank r's the r-th). `device: cuda` on a cluster
without a GPU is an error, not CPU workers; `device: cpu` never asks for a GPU.

**CPU cores.** Workers on a CPU cluster share its nodes' cores in one of four ways
(`cpu_sharing`): `lend` is split while the node's workers all have work, and all the
cores for a step of a worker whose neighbours are idle (workers/cpu_lending.py); `auto`
(the default) lends when the model's weights are at least `LEND_MIN_WEIGHT_BYTES` and
splits otherwise: a small model's step is mostly Python, which a second core does not
shorten, while its OpenMP threads spin on the core the gateway needs; `split` gives
each worker an equal share of the threads, all running at once; `turns` gives every
worker all of its node's cores and has the workers of a node take turns at them, step
by step (workers/cpu_turns.py). On a 2-core node, beside vLLM, SmolLM2 served 0.93-0.95x
lent where split served 0.80-0.91x (alternating sittings), turns 0.85x; the tiny model
(~10 MB of weights) served faster split than lent (docs/performance.md).
"""

from __future__ import annotations

import enum
import ipaddress
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

AUTO = "auto"
LOOPBACK = "127.0.0.1"

# Ray's own resources, which pdserve sets (GPU, CPU share) or Ray measures: a pool's
# resources name custom ones only.
_RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# The smallest amount of a resource Ray can ask for (`ray._raylet.RESOURCE_UNIT_SCALING` is 10,000):
# less is refused only when the actor is made, in words that name no setting.
_RESOURCE_UNIT = 0.0001


def check_kv_host(value: Any) -> str | None:
    """`value` as a kv_host setting (see the module docstring), or a ValueError naming it."""
    if value is None:
        return None
    if value == AUTO:
        return AUTO
    hint = "auto (each node's Ray address), or an IPv4 address of the node (127.0.0.1 on one machine)"
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_host: must be {hint}; got {value!r}")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"kv_host: must be {hint}; got {value!r} (a host name is not resolved: "
                         "peers connect to the address as given)") from None
    if address.version != 4:
        raise ValueError(f"kv_host: IPv6 ({value}) is not supported by the data plane yet; give {hint}")
    if address.is_unspecified:
        raise ValueError(f"kv_host: {value} listens on every interface but is no address a peer can connect to; "
                         f"give {hint}")
    return value


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(value: Any) -> str:
    """`value` as the HTTP `host` setting: an IP address (0.0.0.0 or :: for every interface) or
    a host name as DNS spells one; a ValueError naming it otherwise. ("999.1.1.1" started Ray,
    Serve and every worker before HAProxy failed to bind it.)"""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"host: must be an IP address or a host name to listen on, got {value!r}")
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError(f"host: {value[:64]!r} is neither an IP address nor a host name")
    return value


def check_listenable(host: str) -> None:
    """A ValueError naming `host` unless this machine can listen on it (it resolves to one of
    its addresses): checked before a local run starts anything."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"host: {host!r} does not resolve: {e.strerror or e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address[0], 0))
        except OSError as e:
            raise ValueError(f"host: cannot listen on {host} ({address[0]}): {e.strerror or e}") from None


def bind_host(setting: str | None) -> str:
    """The address a data-plane socket made now, on this node, binds and advertises
    for the kv_host `setting` (already checked by `check_kv_host`). Asks Ray for this
    node's address and the cluster's nodes when the setting leaves them to it."""
    if setting is None:
        setting = AUTO if _ray_nodes() > 1 else LOOPBACK
    if setting == AUTO:
        import ray

        return str(ray.util.get_node_ip_address())
    _check_local(setting)
    return setting


def _ray_nodes() -> int:
    """Live nodes in the Ray cluster this process is connected to (0 without Ray, or where
    Ray is not installed: a lent GPU machine runs the services in one process)."""
    try:
        import ray
    except ImportError:
        return 0
    if not ray.is_initialized():
        return 0
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def _check_local(host: str) -> None:
    """A ValueError naming kv_host when `host` is no address of this machine (the bind would fail
    with ZeroMQ's "Cannot assign requested address")."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise ValueError(f"kv_host: {host} is not an address of the node {socket.gethostname()} ({e.strerror}); "
                         "on several nodes use auto, or leave kv_host unset") from None


def check_resources(name: str, value: Any) -> dict[str, float] | None:
    """`value` as a pool's Ray custom resources (`{"prefill_node": 1}`), or a ValueError naming `name`."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"{name}: must be a non-empty mapping of Ray custom resource names to amounts, "
                         f"e.g. {{\"{name.split('_')[0]}_node\": 1}}; got {value!r}")
    resources: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name}: resource names must be non-empty strings, got {key!r}")
        if key in _RAY_RESOURCES:
            raise ValueError(f"{name}: {key} is Ray's own resource, which pdserve sets for each worker "
                             "(one GPU each on a GPU cluster, else a CPU share); name custom resources only")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise ValueError(f"{name}: {key} must be a number > 0, got {amount!r}")
        if amount < _RESOURCE_UNIT:
            raise ValueError(f"{name}: {key} must be {_RESOURCE_UNIT} at least (Ray counts resources in "
                             f"units of it), got {amount!r}")
        if amount > 1 and amount != int(amount):
            raise ValueError(f"{name}: {key} must be a whole number when above 1 (Ray's rule), got {amount!r}")
        resources[key] = float(amount)
    return resources


class CpuSharing(str, enum.Enum):
    SPLIT = "split"  # an equal share of the threads each, all at once
    TURNS = "turns"  # every worker all of its node's cores, one step at a time
    LEND = "lend"  # split, but all the node's cores for a step while the node's other workers are idle
    AUTO = "auto"  # lend for a model of LEND_MIN_WEIGHT_BYTES or more, else split (the default)


# A decode step at batch 12 on two threads against one (`python bench/step_threads.py --model
# DIR --batch 12`, bfloat16, 2-core Xeon): 0.96x of the time for ~10 MB of weights (the tiny
# model), 0.79x for ~53 MB, 0.68-0.73x for 160-270 MB. Below this size a second core buys a
# step too little to pay for the core its OpenMP threads take from the serving plane.
LEND_MIN_WEIGHT_BYTES = 32 << 20

# Cores a colocated pool's split share leaves to the serving plane, as vLLM's CPU backend
# reserves one for its API server. One colocated worker of the tiny model with every core (2
# OpenMP threads, unpinned) served 0.71x of vLLM's CPU build; on one thread, pinned to a core of
# its own with the gateway, HAProxy and Ray on the other, 1.37x and 1.83x (2 cores, vLLM's
# client at concurrency 16; docs/performance.md).
COLOCATED_PLANE_CORES = 1


class ActorOptions(TypedDict, total=False):
    """Ray actor options (`.options(**...)`): what an actor asks Ray for, and how Ray restarts it."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]  # custom resources (a pool's `*_resources`)
    max_restarts: int
    max_task_retries: int


@dataclass(frozen=True)
class WorkerShare:
    """What each worker actor asks Ray for, the torch threads it runs, and whether the
    workers take turns at their node's cores (then `threads` is capped, on each worker,
    by its own node's cores) or lend them to each other (`threads` is the share)."""

    options: ActorOptions  # num_gpus or num_cpus
    threads: int
    turns: bool = False
    lend: bool = False
    lend_min_weight_bytes: int = 0  # lend only for a model this large (`auto`)
    # A lending worker's threads when its model is under that floor: the split share, which
    # may leave the serving plane cores (`plane_cores`); 0: `threads`.
    split_threads: int = 0


def worker_share(device: str, num_workers: int, cluster: Mapping[str, float],
                 sharing: CpuSharing = CpuSharing.SPLIT, plane_cores: int = 0) -> WorkerShare:
    """One GPU per worker on a cluster that has GPUs (`cluster`: `ray.cluster_resources()`),
    else a share of its CPUs, split, in turns or lent (`sharing`; `auto`: lent for a model
    of `LEND_MIN_WEIGHT_BYTES` or more, which the engine checks once it has loaded it). ValueError, naming `device`,
    where the device asks for a GPU that the cluster does not have.

    `plane_cores`: cores the split share leaves to the serving plane (the gateway, HAProxy,
    Ray) where the cluster has more than that; each worker still gets one thread at least
    (floor division: several workers may leave more). Colocated workers leave one
    (`COLOCATED_PLANE_CORES`). Lending workers keep the whole share (`threads`) and step on
    the split one (`split_threads`) only when their model is under the lending floor; turns
    take every core."""
    gpus = cluster.get("GPU", 0)
    if device.startswith("cuda"):
        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"device: {device} names one GPU of a machine; under Ray each worker sees only the GPU "
                             "Ray gave it, as cuda (use --device cuda)")
        if not gpus:
            raise ValueError("device: cuda, but the Ray cluster has no GPU (`ray status` lists its resources): "
                             "start the GPU nodes, or serve on CPU with --device cpu or auto")
    if gpus and device != "cpu":
        return WorkerShare({"num_gpus": 1}, threads=1)
    cpus = max(1, int(cluster.get("CPU", 1)))
    per_cpu = max(0.01, min(1.0, (cpus - 1) / num_workers)) if cpus > 1 else 0.01
    turns = sharing is CpuSharing.TURNS
    lend = sharing in (CpuSharing.LEND, CpuSharing.AUTO)
    whole = max(1, cpus // num_workers)
    split = max(1, (cpus - plane_cores if cpus > plane_cores else cpus) // num_workers)
    return WorkerShare({"num_cpus": per_cpu}, threads=cpus if turns else whole if lend else split, turns=turns,
                       lend=lend, lend_min_weight_bytes=LEND_MIN_WEIGHT_BYTES if sharing is CpuSharing.AUTO else 0,
                       split_threads=split if lend else 0)


def pool_options(options: ActorOptions, tp: int) -> ActorOptions:
    """What a worker of `tp` tensor-parallel ranks asks Ray for: a GPU a rank where the workers
    get GPUs (an actor lies on one node, so its ranks do too; Ray lists them all in its
    CUDA_VISIBLE_DEVICES, rank r takes the r-th: workers/tp_devices.py), else the worker's CPU share
    (its ranks split the threads: cluster/worker_start.py `pool_engine`)."""
    if tp > 1 and "num_gpus" in options:
        return {**options, "num_gpus": float(tp)}
    return options.copy()


def check_ranks_fit(tp_sizes: Mapping[str, int], nodes: list[dict[str, Any]]) -> None:
    """ValueError naming the pool whose worker needs more GPUs (a rank each) than any live node of
    the cluster has (`nodes`: `ray.nodes()`): an actor lies on one node, and Ray would keep it
    pending until the start's deadline."""
    most = max((n.get("Resources", {}).get("GPU", 0) for n in nodes if n.get("Alive")), default=0)
    for pool, tp in tp_sizes.items():
        if tp > most:
            raise ValueError(f"tensor_parallel_size: a {pool} worker of {tp} ranks needs {tp} GPUs on one node, "
                             f"and no node of this Ray cluster has more than {most:g}")


def with_resources(options: ActorOptions, resources: Mapping[str, float] | None) -> ActorOptions:
    """Ray actor `options` that also require a pool's custom `resources` (None: none)."""
    return {**options, "resources": dict(resources)} if resources else options.copy()
