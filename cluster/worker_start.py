"""Starting the worker actors: each made by name with its pool's resources, then waited
for until it has built its engine; a worker that refuses its settings, or dies in its start
again and again, is an error that names it (the CLI prints it in one line)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from pdserve.cluster.placement import (
    COLOCATED_PLANE_CORES,
    WorkerShare,
    check_ranks_fit,
    pool_options,
    with_resources,
    worker_share,
)
from pdserve.cluster.reports import WorkerInfo
from pdserve.cluster.serve_config import ServeConfig, ServingMode
from pdserve.workers.config import EngineConfig
from pdserve.workers.cpu_turns import lending_dir, turns_path

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"  # the Ray namespace of the workers and the gateway's app
# A worker that Ray has restarted this many times before it first answered is dying in its
# start (the OOM killer while it loads the model, a crash), not slow: Ray restarts it at once,
# for ever, and the start waited out its whole deadline to blame placement. Once may be chance.
START_DEATHS = 2
START_POLL_S = 1.0  # how often the start looks for such a worker while it waits


def start_workers(cfg: ServeConfig, timeout_s: float = 300.0) -> list[Any]:
    """`create_workers`, then wait until every one has built its engine (`wait_for_workers`).
    A start that fails stops the workers it created (detached: they would hold their cores or
    GPUs, and their names, until the next deploy replaced them)."""
    workers = create_workers(cfg)
    try:
        wait_for_workers(workers, timeout_s, cfg.worker_names())
    except Exception:
        kill_workers(workers)
        raise
    return workers


def wait_for_workers(workers: list[Any], timeout_s: float = 300.0,
                     names: Sequence[str] | None = None) -> list[WorkerInfo]:
    """Each worker's info once it has built its engine. A worker that refused its settings (a
    ValueError while building: a directory with no weights, a model it cannot run) is a ValueError
    saying so, which the CLI reports in one line (exit 2); so is one whose process keeps dying
    before it answers (`START_DEATHS`), or dies there and is not restarted (`--max-restarts` 0),
    and workers not up past `timeout_s`, by name (`names`, in the order of `workers`)."""
    refs = [w.info.remote() for w in workers]
    labels = list(names) if names is not None else [f"worker {i}" for i in range(len(refs))]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            infos: list[WorkerInfo] = ray.get(refs, timeout=max(0.0, min(START_POLL_S, deadline - time.monotonic())))
            return infos
        except ray.exceptions.GetTimeoutError as e:
            looping = _crash_looping(workers, refs, labels)
            if looping is not None:
                raise ValueError(looping) from e
            if time.monotonic() >= deadline:
                # Ray waits for resources for ever: an actor no node can hold is only "not ready".
                raise ValueError(_not_up(refs, labels, timeout_s)) from e
        except ray.exceptions.ActorDiedError as e:
            refused = refusal(e)
            if refused is not None:
                raise ValueError(f"a worker could not start: {refused}") from e
            if e.actor_init_failed:
                raise  # its constructor raised something else: a fault, whose traceback says where
            raise ValueError(_died_starting(refs, labels, e)) from e


def _crash_looping(workers: list[Any], refs: list[Any], labels: Sequence[str]) -> str | None:
    """The error for the first worker not up yet that Ray has restarted `START_DEATHS` times, or
    None. Its process died each time while it built its engine; Ray restarts it at once, for ever
    (`max_restarts` -1), so it would only die again, and reload the model each time."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    late = set(pending)
    for handle, ref, label in zip(workers, refs, labels, strict=True):
        if ref in late and (died := restarts(handle)) >= START_DEATHS:
            return (f"{label} died {died} times while starting, before it answered once: its process exits "
                    "while it builds its engine (killed for memory: the model and its KV cache need more than "
                    "the node has; or a crash). Its log on its node (Ray's session logs, "
                    "/tmp/ray/session_latest/logs) says which")
    return None


def _died_starting(refs: list[Any], labels: Sequence[str], error: ray.exceptions.ActorDiedError) -> str:
    """The error for a worker whose process died while it built its engine and that Ray did not
    restart (`--max-restarts` 0, or its restarts used up): the worker by name and Ray's reason,
    in one line (Ray's own error is a dozen lines of actor ids, its traceback more)."""
    label = next((label for label, ref in zip(labels, refs, strict=True) if _died(ref)), "a worker")
    # Ray's message: its first line, the actor's fields (tab-indented), then the reason.
    reason = " ".join(line.strip() for line in str(error).splitlines()[1:] if not line.startswith("\t"))
    reason = reason.removeprefix(ray.exceptions.ActorDiedError.BASE_ERROR_MSG).strip() or "no reason given"
    return (f"{label} died while starting, before it answered once, and is not restarted (--max-restarts): "
            f"killed for memory (the model and its KV cache need more than its node has) or a crash. Ray says: "
            f"{reason[:500]}")


def _died(ref: Any) -> bool:
    """Whether the `info` call `ref` failed because its actor died."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:  # noqa: BLE001 - any other outcome is not this worker's death
        return False
    return False


def restarts(handle: Any) -> int:
    """Times Ray has restarted the actor `handle` (0 where its table cannot be read: a private API)."""
    try:
        from ray._private.state import actors

        return int(actors(handle._actor_id.hex()).get("NumRestarts", 0))
    except Exception:  # noqa: BLE001 - the crash-loop check is a courtesy: the deadline still holds
        return 0


def _not_up(refs: list[Any], labels: Sequence[str], timeout_s: float) -> str:
    """The error for workers whose `info` calls (`refs`) had not answered by the deadline."""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    late = set(pending)
    slow = [label for label, ref in zip(labels, refs, strict=True) if ref in late]
    return (f"workers not up within {timeout_s:g} s: {', '.join(slow)} (Ray could not place them, or they "
            "are still loading the model: `ray status` lists demands no node can meet, such as more GPUs "
            "than the cluster has or a pool resource no node offers)")


def refusal(error: ray.exceptions.ActorDiedError) -> str | None:
    """The message of the ValueError that ended an actor's constructor, as one line; None for any
    other death. Ray hands the driver only the constructor's traceback as text, ending with the
    error: its lines after the last frame's (indented) ones. Not its last line alone: a message of
    several lines (transformers' for a directory with no tokenizer) was taken for no refusal, and
    another error's message that ended in a line `ValueError: ...` for one."""
    if not error.actor_init_failed:
        return None
    lines = str(error).strip().splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith((" ", "\t"))), default=-1) + 1
    said = " ".join(line.strip() for line in lines[start:] if line.strip())
    return said.removeprefix("ValueError: ") if said.startswith("ValueError: ") else None


def create_workers(cfg: ServeConfig) -> list[Any]:
    """Create the named worker actors: one GPU each on a cluster with GPUs, a CPU share
    otherwise; each pool on the nodes that offer its resources (cluster/placement.py).
    They build their engines from now on: `wait_for_workers`. ValueError, before any
    actor starts, when `--device cuda` finds no GPU in the cluster; Ray's error for an actor it
    refuses (a name already taken) after stopping the ones made before it."""
    from pdserve.cluster.ray_actors import DecodeWorkerActor, EngineWorkerActor, PrefillWorkerActor

    colocated = cfg.mode is ServingMode.COLOCATED
    share = worker_share(cfg.engine.device, cfg.num_workers, ray.cluster_resources(), cfg.cpu_sharing,
                         plane_cores=COLOCATED_PLANE_CORES if colocated else 0)
    if "num_gpus" in share.options:  # a GPU a rank, all of a worker's on one node
        check_ranks_fit({pool: cfg.pool_tp(pool) for pool in (("worker",) if colocated else ("prefill", "decode"))},
                        ray.nodes())
    engine = cfg.engine
    if share.turns:  # one lock file per app and node: the app's port tells two apps on one machine apart
        engine = dataclasses.replace(engine, cpu_turns=turns_path(f"{NAMESPACE}-{cfg.port}"))
    elif share.lend:  # likewise one directory per app and node
        engine = dataclasses.replace(engine, cpu_lending=lending_dir(f"{NAMESPACE}-{cfg.port}"),
                                     cpu_lending_min_weight_bytes=share.lend_min_weight_bytes,
                                     cpu_split_threads=share.split_threads)
    # A crashed worker (or one whose engine thread died: it exits) is restarted by
    # Ray under the same name and handle; the gateway re-admits it when it answers.
    # Calls are not retried by Ray: the gateway moves a dead worker's requests itself.
    opts = share.options | {"max_restarts": cfg.max_restarts, "max_task_retries": 0}
    workers: list[Any] = []

    def make(actor_cls: Any, name: str, pool: str, resources: dict[str, float] | None, *args: Any,
             **kwargs: Any) -> None:
        # The actor's name is also its `worker` label in the metrics.
        engine_of_pool, threads = pool_engine(engine, share, cfg.pool_tp(pool))
        asks = with_resources(pool_options(opts, cfg.pool_tp(pool)), resources)
        workers.append(actor_cls.options(name=name, namespace=NAMESPACE, lifetime="detached", **asks).remote(
            engine_of_pool, threads, *args, worker_name=name, exit_on_engine_death=True,
            cluster_secret=cfg.cluster_secret, **kwargs))

    try:
        if cfg.mode is ServingMode.DISAGGREGATED:
            # Each worker gets the other role's settings too: it may be switched to it (cluster/role_switch.py).
            for n in cfg.prefill_names():
                make(PrefillWorkerActor, n, "prefill", cfg.prefill_resources, cfg.transport, cfg.transfer_timeout,
                     kv_host=cfg.kv_host, on_kv_failure=cfg.kv_failure_policy, prefill_timeout_s=cfg.prefill_timeout)
            for n in cfg.decode_names():
                make(DecodeWorkerActor, n, "decode", cfg.decode_resources, cfg.kv_host, cfg.transport,
                     cfg.kv_failure_policy, cfg.prefill_timeout, transfer_timeout_s=cfg.transfer_timeout)
        else:
            # Its inbox (where gateways start requests) binds on this node's address for the kv_host setting.
            for n in cfg.worker_names():
                make(EngineWorkerActor, n, "worker", cfg.worker_resources, kv_host=cfg.kv_host)
    except Exception:
        # Ray refused one (its name still held by a worker an earlier run left): the ones made before
        # it are detached, and no caller gets their handles to stop them.
        kill_workers(workers)
        raise
    return workers


def pool_engine(engine: EngineConfig, share: WorkerShare, tp: int) -> tuple[EngineConfig, int]:
    """A pool's engine config and torch threads: its tensor-parallel size; a tensor-parallel
    worker's ranks split the pool's share of the cores (they neither lend them nor take turns:
    every rank steps at once), so it steps on the split share."""
    if tp == 1:
        # A pool of one rank beside a cluster-wide size (--tensor-parallel-size 2 --decode-tp 1):
        # the engine config carries that size, so the pool's own must replace it here too.
        one = engine if engine.tensor_parallel_size == 1 else dataclasses.replace(engine, tensor_parallel_size=1)
        return one, share.threads
    split = dataclasses.replace(engine, tensor_parallel_size=tp, cpu_turns=None, cpu_lending=None,
                                cpu_lending_min_weight_bytes=0, cpu_split_threads=0)
    return split, share.split_threads or share.threads




def kill_workers(workers: list[Any]) -> None:
    """Stop the worker actors of a start that failed (these handles only: never another run's)."""
    for handle in workers:
        try:
            ray.kill(handle)
        except Exception as e:  # noqa: BLE001 - the start's own error is the one to report
            log.warning("stopping a worker of a start that failed: %r", e)


def find_worker(name: str) -> Any | None:
    """The named worker's handle, or None while Ray knows no such actor (it is being
    created, or it died for good): a gateway starts with the workers that exist and
    asks again for the others. Untyped, as Ray's handles are: the backends take it for
    the Protocol of its kind (cluster/worker_handle.py)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def first_worker_info(names: Sequence[str], timeout_s: float,
                      lookup: Callable[[str], Any | None] = find_worker) -> WorkerInfo:
    """What the workers say of the model, from the first that answers, all asked at once: a
    gateway replica starts while they build their engines (serve_app.py), and one dead or slow
    worker must not hold it up. One that fails its call (dead, restarting) is asked again a
    second later; RuntimeError past `timeout_s` with no answer."""
    deadline = time.monotonic() + timeout_s
    asked: dict[Any, str] = {}  # an info call in flight -> its worker
    while True:
        for name in set(names) - set(asked.values()):
            handle = lookup(name)
            if handle is not None:
                asked[handle.info.remote()] = name
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"no pdserve worker answered within {timeout_s:.0f} s")
        if not asked:  # none exists yet
            time.sleep(min(START_POLL_S, left))
            continue
        done, _ = ray.wait(list(asked), num_returns=1, timeout=min(START_POLL_S, left))
        failed = False
        for ref in done:
            del asked[ref]
            try:
                info: WorkerInfo = ray.get(ref, timeout=0)
                return info
            except ray.exceptions.RayError:
                failed = True
        if failed:  # its handle is asked again next round: not at once, a dead actor fails at once
            time.sleep(min(START_POLL_S, max(0.0, deadline - time.monotonic())))
