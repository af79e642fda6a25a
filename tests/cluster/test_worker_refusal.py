"""A worker that refuses its settings while it builds its engine (a directory with no weights, a
model it cannot run) stops `pdserve serve` with that reason in one line (a ValueError: the CLI's
`pdserve: error: ...`, exit 2), not a 70-line traceback of Ray's actor machinery. Any other
death of a worker is raised as Ray gave it."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from pdserve.cluster import serve_app, worker_start  # noqa: E402 - after the skip: it imports Ray


def died_in_constructor(last_line: str) -> Any:
    """What `ray.get` raises for a call to an actor whose constructor raised: Ray's own
    ActorDiedError, built from the constructor's task error as Ray builds it."""
    task_error = ray.exceptions.RayTaskError(
        "PrefillService.__init__", f"Traceback (most recent call last):\n  File \"engine.py\", line 1\n{last_line}",
        RuntimeError(last_line))
    return ray.exceptions.ActorDiedError.from_task_error(task_error)


class Handle:
    class info:  # noqa: N801 - an actor method's shape: `handle.info.remote()`
        @staticmethod
        def remote() -> str:
            return "ref"


def test_a_worker_that_refuses_its_model_stops_the_start_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    error = died_in_constructor("ValueError: model: no .safetensors weights in /models/x")

    def get(refs: Any, timeout: float) -> None:
        raise error

    monkeypatch.setattr(worker_start.ray, "get", get)
    with pytest.raises(ValueError) as caught:
        worker_start.wait_for_workers([Handle(), Handle()])
    assert str(caught.value) == "a worker could not start: model: no .safetensors weights in /models/x"
    assert caught.value.__cause__ is error


def test_a_refusal_of_several_lines_stops_the_start_with_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers refuses a model directory with no tokenizer files (weights and config.json
    copied, the tokenizer not) with a ValueError of five lines: only a one-line error was taken
    for a refusal (the traceback's last line must start with `ValueError: `), so this one ended
    the start in Ray's 70-line traceback, exit 1. Its lines make the one line, in order."""
    error = died_in_constructor(
        "ValueError: Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
        "serialization file, \n(2) a slow tokenizer instance to convert or \n(3) an equivalent slow tokenizer "
        "class to instantiate and convert. \nYou need to have sentencepiece or tiktoken installed to convert a "
        "slow tokenizer to a fast one.")

    def get(refs: Any, timeout: float) -> None:
        raise error

    monkeypatch.setattr(worker_start.ray, "get", get)
    with pytest.raises(ValueError) as caught:
        worker_start.wait_for_workers([Handle()])
    assert str(caught.value) == (
        "a worker could not start: Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` "
        "library serialization file, (2) a slow tokenizer instance to convert or (3) an equivalent slow tokenizer "
        "class to instantiate and convert. You need to have sentencepiece or tiktoken installed to convert a slow "
        "tokenizer to a fast one.")


@pytest.mark.parametrize("last_line", ["RuntimeError: CUDA error: out of memory", "MemoryError", "",
                                       "RuntimeError: boom\nValueError: not the error raised"])
def test_any_other_death_is_raised_as_ray_gave_it(monkeypatch: pytest.MonkeyPatch, last_line: str) -> None:
    error = died_in_constructor(last_line)

    def get(refs: Any, timeout: float) -> None:
        raise error

    monkeypatch.setattr(worker_start.ray, "get", get)
    with pytest.raises(ray.exceptions.ActorDiedError) as caught:
        worker_start.wait_for_workers([Handle()])
    assert caught.value is error
    assert worker_start.refusal(error) is None


def test_a_death_after_the_constructor_is_not_a_refusal() -> None:
    assert worker_start.refusal(ray.exceptions.ActorDiedError()) is None


def _joined_cluster(monkeypatch: pytest.MonkeyPatch, created: list[Handle]) -> None:
    """A start on a Ray cluster it joined (nothing local to start), whose workers are `created`."""
    from pdserve.cluster import drain_flag

    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: False)
    monkeypatch.setattr(serve_app, "init_ray", lambda cfg: None)
    monkeypatch.setattr(drain_flag, "lower_flag", lambda port: None)
    monkeypatch.setattr(serve_app, "cluster_gpus", lambda: 0.0)
    monkeypatch.setattr(serve_app, "create_workers", lambda cfg: created)


@pytest.mark.parametrize("fails", ["worker", "app"])
def test_a_start_that_fails_on_a_joined_cluster_stops_the_workers_it_created(monkeypatch: pytest.MonkeyPatch,
                                                                             fails: str) -> None:
    """The workers are detached named actors: on a cluster `pdserve serve` joined (RAY_ADDRESS, or
    one `ray start` left on the machine), those of a start that failed (a worker refused its model,
    or the gateway app did not deploy) lived on, holding their cores or GPUs, and the next start
    failed on "The name ... is already taken" until someone killed them by hand. The ones this
    start created are stopped before the error."""
    from types import SimpleNamespace

    from pdserve.cluster.serve_config import serve_config

    created = [Handle(), Handle()]
    killed: list[Any] = []
    _joined_cluster(monkeypatch, created)
    monkeypatch.setattr(serve_app.serve, "start", lambda **kwargs: None)

    def started(workers: Any, timeout_s: float = 300.0, names: Any = None) -> list[Any]:
        if fails == "worker":
            raise ValueError("a worker could not start: model: no .safetensors weights in /models/x")
        return [SimpleNamespace(dtype="float32")]

    def deploy(targets: Any, **kwargs: Any) -> None:  # (sent while the workers start)
        if fails == "app":
            raise RuntimeError("Deploying the app 'pdserve' failed")

    monkeypatch.setattr(serve_app, "wait_for_workers", started)
    monkeypatch.setattr(serve_app, "gateway_app", lambda cfg: None)
    monkeypatch.setattr(serve_app.serve, "run_many", deploy)
    deleted: list[str] = []
    monkeypatch.setattr(serve_app.serve, "delete", lambda name, **kwargs: deleted.append(name))
    monkeypatch.setattr(serve_app.ray, "kill", lambda handle, **kwargs: killed.append(handle))
    with pytest.raises((ValueError, RuntimeError), match="could not start" if fails == "worker" else "Deploying"):
        serve_app.run(serve_config({"model": "/models/x"}))
    assert killed == created
    # The app sent while the workers started is deleted too: its replica would wait for them.
    assert deleted == (["pdserve"] if fails == "worker" else [])


def test_the_serve_yamls_start_stops_the_workers_it_created_when_one_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_workers` (the Serve YAML's application builder, deploy/pdworker_start.py) made detached
    workers and raised when one refused its model: the others lived on, holding their cores or
    GPUs, until another deploy happened to replace them. It stops the ones it created, as
    `pdserve serve` does."""
    from pdserve.cluster.serve_config import serve_config

    created = [Handle(), Handle()]
    killed: list[Any] = []
    monkeypatch.setattr(worker_start, "create_workers", lambda cfg: created)

    def refused(workers: Any, timeout_s: float = 300.0, names: Any = None) -> None:
        raise ValueError("a worker could not start: model: no .safetensors weights in /models/x")

    monkeypatch.setattr(worker_start, "wait_for_workers", refused)
    monkeypatch.setattr(worker_start.ray, "kill", lambda handle, **kwargs: killed.append(handle))
    with pytest.raises(ValueError, match="could not start"):
        worker_start.start_workers(serve_config({"model": "/models/x"}))
    assert killed == created


def test_workers_created_before_one_that_cannot_be_created_are_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray refuses an actor at `.remote()` (its name still held by a worker an earlier run left
    on the cluster: "The name ... is already taken"): the workers `create_workers` had made
    before it, detached, were never handed back to anyone who would stop them, and held their
    cores or GPUs (and their names, failing the next start) for the cluster's life."""
    from pdserve.cluster import ray_actors
    from pdserve.cluster.serve_config import serve_config

    made: list[str] = []
    killed: list[Any] = []
    taken = "pdserve-decode-0"

    class Actor:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: Any, **kwargs: Any) -> str:
            if self.name == taken:
                raise ValueError(f"The name {taken} (namespace=pdserve) is already taken.")
            made.append(self.name)
            return self.name

    for cls in ("PrefillWorkerActor", "DecodeWorkerActor", "EngineWorkerActor"):
        monkeypatch.setattr(ray_actors, cls, type(cls, (), {
            "options": staticmethod(lambda name, **options: Actor(name))}))
    monkeypatch.setattr(worker_start.ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(worker_start.ray, "kill", lambda handle, **kwargs: killed.append(handle))
    cfg = serve_config({"model": "/models/x", "prefill": 2, "decode": 2})
    with pytest.raises(ValueError, match="already taken"):
        worker_start.create_workers(cfg)
    assert made == ["pdserve-prefill-0", "pdserve-prefill-1"]
    assert killed == made


def test_workers_not_up_by_the_deadline_are_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker Ray cannot place (a pool resource no node offers, more GPU workers than GPUs) waits
    for resources for ever: at the deadline the start ended in Ray's bare GetTimeoutError ("Get
    timed out: some object(s) not ready"), a traceback that named neither the worker nor why. It
    is a ValueError (the CLI's one line, exit 2) naming the workers that are not up."""
    refs = [object() for _ in range(3)]
    calls = iter(refs)

    class Slow:
        class info:  # noqa: N801 - an actor method's shape
            @staticmethod
            def remote() -> object:
                return next(calls)

    def get(refs: Any, timeout: float) -> None:
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    def wait(pending: list[Any], num_returns: int, timeout: float) -> tuple[list[Any], list[Any]]:
        return pending[:1], pending[1:]  # the first answered; the others are still waiting

    from pdserve.cluster.serve_config import serve_config

    monkeypatch.setattr(worker_start.ray, "get", get)
    monkeypatch.setattr(worker_start.ray, "wait", wait)
    monkeypatch.setattr(worker_start.ray, "kill", lambda handle, **kwargs: None)
    monkeypatch.setattr(worker_start, "create_workers", lambda cfg: [Slow(), Slow(), Slow()])
    with pytest.raises(ValueError) as caught:
        worker_start.start_workers(serve_config({"model": "/models/x", "prefill": 1, "decode": 2}), timeout_s=0.2)
    message = str(caught.value)
    assert message.startswith("workers not up within 0.2 s: pdserve-decode-0, pdserve-decode-1 ")
    assert "pdserve-prefill-0" not in message and "\n" not in message
    assert "ray status" in message
    assert isinstance(caught.value.__cause__, ray.exceptions.GetTimeoutError)


def test_a_gateway_no_node_can_place_ends_the_start_at_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve waits for ever for a replica no node can place (`--gateway-resources` naming a resource
    no node offers): it only updates the app's message. `pdserve serve` hung there, its workers up,
    never serving and never failing. At a deadline it is a ValueError (the CLI's one line) with
    Serve's reason; the app is deleted and the workers stopped."""
    from types import SimpleNamespace

    from ray.serve.schema import ApplicationStatus

    from pdserve.cluster.serve_config import serve_config

    why = ("Deployment 'pdserve-gateway' in application 'pdserve' has 1 replicas that have taken more than 30s "
           "to be scheduled. Resources required for each replica: {'CPU': 0.01, 'gatway_node': 1.0}")
    pending = SimpleNamespace(status=ApplicationStatus.DEPLOYING, message="",
                              deployments={"pdserve-gateway": SimpleNamespace(message=why)})
    polls: list[float] = []

    def status() -> Any:
        polls.append(1.0)
        return SimpleNamespace(applications={"pdserve": pending})

    def serve_run(app: Any, **kwargs: Any) -> None:  # Serve's own wait: until RUNNING, however long
        while status().applications["pdserve"].status is not ApplicationStatus.RUNNING:
            if len(polls) > 50:
                raise AssertionError("the start waited for the gateway with no deadline")

    created = [Handle()]
    killed: list[Any] = []
    deleted: list[str] = []
    _joined_cluster(monkeypatch, created)
    monkeypatch.setattr(serve_app, "wait_for_workers", lambda *a, **k: [SimpleNamespace(dtype="float32")])
    monkeypatch.setattr(serve_app, "gateway_app", lambda cfg: "app")
    monkeypatch.setattr(serve_app.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(serve_app.serve, "run", serve_run)
    monkeypatch.setattr(serve_app.serve, "run_many", lambda targets, **kwargs: [None])
    monkeypatch.setattr(serve_app.serve, "status", status)
    monkeypatch.setattr(serve_app.serve, "delete", lambda name, **kwargs: deleted.append(name))
    monkeypatch.setattr(serve_app.ray, "kill", lambda handle, **kwargs: killed.append(handle))
    monkeypatch.setattr(serve_app, "GATEWAY_START_S", 0.05, raising=False)
    monkeypatch.setattr(serve_app, "GATEWAY_POLL_S", 0.01, raising=False)
    with pytest.raises(ValueError) as caught:
        serve_app.run(serve_config({"model": "/models/x", "gateway_resources": {"gatway_node": 1}}))
    assert str(caught.value).startswith("the gateway is not up within 0.05 s: Deployment 'pdserve-gateway'")
    assert "gatway_node" in str(caught.value)
    assert deleted == ["pdserve"] and killed == created


def test_a_worker_that_keeps_dying_while_it_starts_ends_the_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose process dies while it builds its engine (the OOM killer, for a model its
    node's memory cannot hold; a crash) is restarted by Ray at once, for ever (`--max-restarts`
    -1): ~2 restarts a second for a quick death, each loading the model again and logging Ray's
    death notice, while the start waited out its whole deadline (300 s) and then blamed
    placement ("Ray could not place them, or they are still loading the model"). A worker that
    has died twice before it ever answered ends the start at once, a ValueError (the CLI's one
    line) naming it and saying why."""
    refs = [object(), object()]
    handles = [SimpleNamespace(info=SimpleNamespace(remote=lambda ref=ref: ref), ref=ref) for ref in refs]
    deaths = {id(handles[0]): iter([0, 0, 0, 0]), id(handles[1]): iter([0, 1, 2, 3])}
    gets: list[float] = []

    def get(refs: Any, timeout: float) -> None:
        gets.append(timeout)
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(worker_start.ray, "get", get)
    monkeypatch.setattr(worker_start.ray, "wait", lambda pending, num_returns, timeout: ([], list(pending)))
    monkeypatch.setattr(worker_start, "restarts", lambda handle: next(deaths[id(handle)]), raising=False)
    with pytest.raises(ValueError) as caught:
        worker_start.wait_for_workers(handles, timeout_s=600.0, names=["pdserve-prefill-0", "pdserve-decode-0"])
    message = str(caught.value)
    assert message.startswith("pdserve-decode-0 died 2 times while starting")
    assert "pdserve-prefill-0" not in message and "\n" not in message
    assert "memory" in message
    assert len(gets) <= 3 and all(t <= worker_start.START_POLL_S for t in gets)


@pytest.mark.parametrize(("settings", "waited"), [({}, 300.0), ({"worker_start_timeout": 1800}, 1800.0)])
def test_the_wait_for_workers_at_a_start_is_the_operators_to_set(monkeypatch: pytest.MonkeyPatch,
                                                                 settings: dict[str, Any], waited: float) -> None:
    """`pdserve serve` waited 300 s for its workers to build their engines, fixed: a model that
    loads and compiles for longer (a large checkpoint on CPU, a slow disk) could never be served,
    its start ended as "not up within 300 s" however often it was tried (a Serve YAML has
    `worker_timeout_s`). `--worker-start-timeout` sets it; 300 s by default, as before."""
    from pdserve.cluster.serve_config import serve_config

    created = [Handle()]
    waits: list[float] = []
    _joined_cluster(monkeypatch, created)
    monkeypatch.setattr(serve_app.serve, "start", lambda **kwargs: None)

    def wait(workers: Any, timeout_s: float = 300.0, names: Any = None) -> list[Any]:
        waits.append(timeout_s)
        raise ValueError("workers not up")

    monkeypatch.setattr(serve_app, "wait_for_workers", wait)
    monkeypatch.setattr(serve_app.ray, "kill", lambda handle, **kwargs: None)
    # The gateway app, sent while the workers start, and deleted when they do not.
    monkeypatch.setattr(serve_app, "gateway_app", lambda cfg: "app")
    monkeypatch.setattr(serve_app.serve, "run_many", lambda targets, **kwargs: [None])
    monkeypatch.setattr(serve_app.serve, "delete", lambda name, **kwargs: None)
    with pytest.raises(ValueError, match="not up"):
        serve_app.run(serve_config({"model": "/models/x", **settings}))
    assert waits == [waited]


@pytest.mark.parametrize(("settings", "gpus"), [({"tensor_parallel_size": 2}, [2.0, 2.0]),
                                               ({"decode_tp": 2}, [1.0, 2.0]), ({"prefill_tp": 4}, [4.0, 1.0])])
def test_disaggregated_workers_ask_ray_for_a_gpu_a_rank_of_their_pool(
        monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], gpus: list[float]) -> None:
    """Each pool's workers ask for as many GPUs as their pool's ranks (prefill, then decode); the
    same settings on CPU workers (`device: cpu`) of a GPU cluster hold no GPU."""
    from pdserve.cluster.serve_config import serve_config

    made, options = _fake_actors(monkeypatch, gpus=8.0)
    cfg = serve_config({"model": "/models/x", **settings}).fit_to_cluster(lambda: 8.0)
    worker_start.create_workers(cfg)
    assert made == cfg.worker_names() and [o.get("num_gpus") for o in options] == gpus
    assert cfg.worker_gpus() == sum(gpus)
    made.clear()
    options.clear()
    cpu = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, device="cpu"))
    worker_start.create_workers(cpu)
    assert made == cpu.worker_names()
    assert all("num_gpus" not in o for o in options)


def test_colocated_workers_of_n_ranks_are_fitted_node_by_node() -> None:
    """Six GPUs on two nodes of three: workers of two ranks fit one a node (a worker's ranks lie on
    one node), not three; one rank a worker, six; without the nodes, the cluster's GPUs over N."""
    from pdserve.cluster.serve_config import serve_config

    def fit(tp: int, nodes: list[float] | None) -> int:
        cfg = serve_config({"model": "/models/x", "mode": "colocated", "tensor_parallel_size": tp})
        return cfg.fit_to_cluster(lambda: 6.0, (lambda: nodes) if nodes is not None else None).num_workers

    assert (fit(2, [3.0, 3.0]), fit(1, [3.0, 3.0]), fit(2, None), fit(4, [3.0, 3.0])) == (2, 6, 3, 1)


@pytest.mark.parametrize(("tp", "gpus", "workers"), [(2, 2, 1), (2, 8, 4), (4, 8, 2), (1, 2, 2)])
def test_a_colocated_worker_of_n_ranks_asks_ray_for_n_gpus(
        monkeypatch: pytest.MonkeyPatch, tp: int, gpus: int, workers: int) -> None:
    """On a GPU cluster each rank holds a GPU: a worker of N ranks is one actor asking for N (Ray
    puts them on one node and lists them in its CUDA_VISIBLE_DEVICES), and the workers left to
    the cluster are its GPUs over N, not one per GPU (which Ray could never place)."""
    from pdserve.cluster.serve_config import serve_config

    made, options = _fake_actors(monkeypatch, gpus=float(gpus))
    cfg = serve_config({"model": "/models/x", "mode": "colocated", "tensor_parallel_size": tp}).fit_to_cluster(
        lambda: float(gpus))
    assert cfg.num_workers == workers and cfg.worker_gpus() == gpus
    worker_start.create_workers(cfg)
    assert made == cfg.worker_names()
    assert [o.get("num_gpus") for o in options] == [float(tp)] * workers
    assert all("num_cpus" not in o for o in options)


def _fake_actors(monkeypatch: pytest.MonkeyPatch, gpus: float = 2.0) -> tuple[list[str], list[dict[str, Any]]]:
    """Worker actor classes that record each actor's name and Ray options instead of making it, on
    a Ray cluster of 16 CPUs and `gpus` GPUs."""
    from pdserve.cluster import ray_actors

    made: list[str] = []
    options: list[dict[str, Any]] = []

    class Actor:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: Any, **kwargs: Any) -> str:
            made.append(self.name)
            return self.name

    def make(name: str, **asked: Any) -> Actor:
        options.append(asked)
        return Actor(name)

    for cls in ("PrefillWorkerActor", "DecodeWorkerActor", "EngineWorkerActor"):
        monkeypatch.setattr(ray_actors, cls, type(cls, (), {"options": staticmethod(make)}))
    monkeypatch.setattr(worker_start.ray, "kill", lambda handle, **kwargs: None)
    monkeypatch.setattr(worker_start.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": gpus})
    # One node of them all, and a dead one with more (it places nothing).
    monkeypatch.setattr(worker_start.ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": gpus}},
                                                            {"Alive": False, "Resources": {"GPU": 64.0}}])
    return made, options


def test_a_worker_of_more_ranks_than_a_node_has_gpus_is_refused_before_any_is_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight GPUs on four nodes of two: a worker of four ranks fits no node (an actor lies on one),
    and Ray would keep it pending until the start's deadline; refused by name instead."""
    from pdserve.cluster.serve_config import serve_config

    made, _ = _fake_actors(monkeypatch, gpus=8.0)
    monkeypatch.setattr(worker_start.ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}] * 4)
    cfg = serve_config({"model": "/models/x", "decode_tp": 4}).fit_to_cluster(lambda: 8.0)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: a decode worker of 4 ranks needs 4 GPUs on one "
                                         r"node, and no node of this Ray cluster has more than 2$"):
        worker_start.create_workers(cfg)
    assert made == []


def test_a_worker_that_dies_starting_and_is_not_restarted_ends_the_start_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--max-restarts 0` a worker whose process died while it built its engine (the OOM
    killer) ended `pdserve serve` in Ray's traceback of actor ids, exit 1, naming no worker. Now
    it is the CLI's one line: the worker by name, what usually kills a start, Ray's reason."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    context = ActorDiedErrorContext(
        class_name="DecodeService", actor_id=bytes(16), pid=4242, name="pdserve-decode-0", ray_namespace="pdserve",
        node_ip_address="10.0.0.2",
        error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
                      "Worker exit detail: Worker unexpectedly exits with a connection error code 2.\n"
                      "(1) The process is killed by SIGKILL by OOM killer due to high memory usage.")
    error = ray.exceptions.ActorDiedError(context)
    refs = ["prefill-ref", "decode-ref"]
    handles = [SimpleNamespace(info=SimpleNamespace(remote=lambda ref=ref: ref)) for ref in refs]

    def get(got: Any, timeout: float) -> None:
        if got == "prefill-ref":
            raise ray.exceptions.GetTimeoutError("not ready")
        raise error

    monkeypatch.setattr(worker_start.ray, "get", get)
    monkeypatch.setattr(worker_start.ray, "wait", lambda pending, timeout, **kw: (list(pending), []))
    with pytest.raises(ValueError) as caught:
        worker_start.wait_for_workers(handles, timeout_s=60.0, names=["pdserve-prefill-0", "pdserve-decode-0"])
    message = str(caught.value)
    assert message.startswith("pdserve-decode-0 died while starting") and "\n" not in message
    assert "memory" in message and "OOM killer" in message and "actor_id" not in message
    assert caught.value.__cause__ is error


class _Ref:
    """An info call in flight: it answers `value` (raises it, if an exception) from `at` on."""

    def __init__(self, value: Any, at: float) -> None:
        self.value, self.at = value, at


class _Worker:
    def __init__(self, answer: Any, after_s: float | None) -> None:
        self.answer, self.after_s, self.calls = answer, after_s, 0
        self.info = SimpleNamespace(remote=self._remote)

    def _remote(self) -> _Ref:
        self.calls += 1
        return _Ref(self.answer, float("inf") if self.after_s is None else time.monotonic() + self.after_s)


def _fake_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(refs: list[_Ref], num_returns: int, timeout: float) -> tuple[list[_Ref], list[_Ref]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done = [r for r in refs if r.at <= time.monotonic()]
            if done:
                return done[:num_returns], [r for r in refs if r not in done[:num_returns]]
            time.sleep(0.005)
        return [], refs

    def get(ref: _Ref, timeout: float) -> Any:
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    monkeypatch.setattr(worker_start.ray, "wait", wait)
    monkeypatch.setattr(worker_start.ray, "get", get)
    monkeypatch.setattr(worker_start, "START_POLL_S", 0.05)


def test_a_gateway_takes_the_first_worker_that_answers_not_the_first_it_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica starts while the workers build their engines: one hung (a SIGSTOPped process)
    or dead worker must not hold it up past the first that answers; one that is not made yet is
    looked for again."""
    _fake_ray(monkeypatch)
    dead = _Worker(ray.exceptions.RayActorError(), 0.0)
    workers = {"hung": _Worker("never", None), "dead": dead, "slow": _Worker("info", 0.3)}
    started = time.monotonic()
    seen: list[str] = []

    def lookup(name: str) -> Any:
        seen.append(name)
        return None if name == "late" else workers[name]

    assert worker_start.first_worker_info(["hung", "dead", "late", "slow"], 10.0, lookup=lookup) == "info"
    assert time.monotonic() - started < 2.0  # not the hung one's time, nor a per-worker timeout
    assert 2 <= dead.calls <= 10  # asked again, a poll apart, not in a busy loop
    assert seen.count("late") >= 2 and workers["hung"].calls == 1  # the hung one's call stays in flight


def test_a_gateway_with_no_worker_answering_fails_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_ray(monkeypatch)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no pdserve worker answered within 1 s"):
        worker_start.first_worker_info(["a", "b"], 0.6, lookup=lambda name: _Worker("never", None))
    assert 0.6 <= time.monotonic() - started < 1.5
