"""A decode worker that hangs without dying, through the disaggregated coordinator: real
worker services (real engines, ZeroMQ KV transport on loopback) in one process, Ray
handles replaced by `LocalActor`. The hang is its engine thread blocked (what a
SIGSTOP or a step that never returns makes of it): no token, no answer to the polls.
A real process SIGSTOPped under `pdserve serve` is the chaos matrix's scenario (j)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalActor, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.actors import DecodeService, EngineService, PrefillService
from pdserve.cluster.backend import ColocatedBackend
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import RouterConfig
from pdserve.workers.config import EngineConfig
from pdserve.workers.tiny.builder import TinyModelSpec

BS = 16
STALL_S = 1.0  # the stall timeout under test (0.5 s: a loaded 2-core CI machine paused healthy workers that long)
HANG_S = 30.0  # how long a blocked engine thread stays blocked unless let go: past every request's deadline
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


_services: list[Any] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _services:
        _services.pop().close()


def config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_model_len=1024, block_size=BS, max_num_batched_tokens=1024,
                        num_kv_blocks=512)


class Hang:
    """Blocks a worker's engine thread (`start`) until `release` or HANG_S."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.gate = threading.Event()
        self.released_at: float | None = None

    def start(self) -> None:
        self.service.async_engine.post(lambda: self.gate.wait(HANG_S))

    def release(self) -> None:
        self.released_at = time.monotonic()
        self.gate.set()


def cluster(model_dir: Path, restarted: list[Any]) -> tuple[DisaggregatedBackend, dict[str, Any]]:
    base = config(model_dir)
    services: dict[str, Any] = {"p0": PrefillService(base, 1)}
    services.update({f"d{i}": DecodeService(base, 1, "127.0.0.1") for i in range(2)})
    _services.extend(services.values())
    actors = {k: LocalActor(v) for k, v in services.items()}
    router = Router(RouterConfig(local_prefill_threshold_tokens=0), BS)
    backend = DisaggregatedBackend({"p0": actors["p0"]}, {"d0": actors["d0"], "d1": actors["d1"]}, router,
                                   poll_s=0.01, stall_timeout_s=STALL_S, restart=restarted.append)
    return backend, services | {f"actor:{k}": a for k, a in actors.items()}


PROMPTS = [torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (40, 90, 33, 150, 61, 77, 20, 45)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


async def stream(backend: Any, i: int, received: list[int], gaps: list[float]) -> list[int]:
    """Prompt i's greedy tokens, read at a client's pace; each wait for a delta goes in `gaps`."""
    tokens: list[int] = []
    last = time.monotonic()
    async for out in backend.generate(f"r{i}", PROMPTS[i], GREEDY, DEADLINE_S):
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        tokens += out.outputs[0].token_ids
        received[0] += len(out.outputs[0].token_ids)
        await asyncio.sleep(0.002)
    return tokens


def test_a_hung_decode_worker_is_given_up_its_streams_move_and_equal_offline(model_dir: Path) -> None:
    """8 greedy streams; the decode worker with the most of them hangs mid-stream. After
    the stall timeout its tries move to the other worker from what their clients have,
    and it is restarted (here: let go, as a SIGCONT would, so its stale tokens come in
    too). Every output equals the offline one, no token lost or repeated; the worker
    answers again and is back in its pool."""
    restarted: list[Any] = []
    backend, parts = cluster(model_dir, restarted)
    hangs = {w: Hang(parts[w]) for w in ("d0", "d1")}
    hung: list[str] = []
    got: list[list[int]] = []
    gaps: list[float] = []

    def on_restart(handle: Any) -> None:
        restarted.append(handle)
        hangs[hung[0]].release()

    backend._restart = on_restart

    async def main() -> None:
        received = [0]

        async def hang_one() -> None:
            while received[0] < 60:
                await asyncio.sleep(0.001)
            busiest = max(("d0", "d1"), key=lambda w: backend.calls.counts().get(w, 0))
            hung.append(busiest)
            hangs[busiest].start()

        try:
            tasks = [asyncio.ensure_future(stream(backend, i, received, gaps)) for i in range(len(PROMPTS))]
            await hang_one()
            got.extend(await asyncio.gather(*tasks))
            # Back in its pool: it answers a poll again and the router may route to it.
            async with asyncio.timeout(10):
                while hung[0] in backend._dead:
                    await asyncio.sleep(0.01)
        finally:
            for h in hangs.values():
                h.release()
            await backend.close()

    asyncio.run(main())
    llm = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=512, progress=False)
    assert got == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    victim = hung[0]
    assert backend.events.stalled == 1 and restarted == [backend.decode[victim]]
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.exhausted == 0
    assert backend.events.readmitted == 1 and backend.router.loads[victim].healthy
    assert max(gaps) < HANG_S / 2  # they moved on: nobody waited for the hang to end by itself
    engine = parts[victim].engine
    assert not engine.has_unfinished_requests()  # its old tries were aborted once it ran again


def test_a_hung_colocated_worker_is_given_up_and_its_streams_move(model_dir: Path) -> None:
    """The same hang on one of two colocated workers (it had no stall watch: its streams
    waited for their deadline): after the stall timeout its tries move to the other worker,
    it is restarted (let go here), and once it answers a poll it is routable again; every
    output equals the offline one."""
    services = [EngineService(config(model_dir), 1, worker_name=f"w{i}") for i in range(2)]
    _services.extend(services)
    restarted: list[Any] = []
    hung: list[int] = []
    hangs = [Hang(s) for s in services]
    actors = [LocalActor(s) for s in services]

    def on_restart(handle: Any) -> None:
        """What Ray's restart looks like to the watch: answers from a new process. (Its old
        one, let go here, is the new one too: the watch takes no answer from the old.)"""
        restarted.append(handle)
        services[hung[0]].incarnation += "-restarted"
        hangs[hung[0]].release()

    backend = ColocatedBackend(actors, stall_timeout_s=STALL_S, restart=on_restart)  # type: ignore[arg-type]
    assert backend.watch is not None
    got: list[list[int]] = []
    gaps: list[float] = []

    async def main() -> None:
        received = [0]

        try:
            tasks = [asyncio.ensure_future(stream(backend, i, received, gaps)) for i in range(len(PROMPTS))]
            while received[0] < 60:
                await asyncio.sleep(0.001)
            counts = backend.tries()
            hung.append(max((0, 1), key=lambda i: counts.get(backend.names[i], 0)))
            hangs[hung[0]].start()
            got.extend(await asyncio.gather(*tasks))
            async with asyncio.timeout(10):  # routable again once it answers a poll
                while hung[0] not in backend._live():
                    await asyncio.sleep(0.01)
        finally:
            for h in hangs:
                h.release()
            await backend.close()

    asyncio.run(main())
    llm = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=512, progress=False)
    assert got == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert restarted == [actors[hung[0]]]
    r = backend.reliability()
    assert (r.workers_stalled, r.workers_lost, r.workers_readmitted, r.workers_restarted) == (1, 1, 1, 1)
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.exhausted == 0
    assert max(gaps) < HANG_S / 2  # they moved on: nobody waited for the hang to end by itself
    assert not services[hung[0]].engine.has_unfinished_requests()  # its old tries were aborted once it ran again


def test_a_given_up_colocated_worker_is_not_readmitted_by_its_own_old_process() -> None:
    """Given up while it still answers (no token computed): until Ray's kill lands, its old
    process's answers do not put it back in routing; its new process's do."""
    from pdserve.cluster.colocated_watch import ColocatedWatch
    from pdserve.cluster.reports import Progress
    from pdserve.workers.stats import EngineSnapshot

    class Pool:
        def __init__(self) -> None:
            self.routable, self.failed = True, 0

        def handles(self) -> dict[str, Any]:
            return {"w0": worker}

        def tries(self) -> dict[str, int]:
            return {} if self.failed else {"w0": 1}  # failed tries leave

        def down(self, name: str) -> None:
            self.routable = False

        def up(self, name: str) -> None:
            self.routable = True

        def fail_tries(self, name: str, error: Callable[[], BaseException]) -> None:
            self.failed += 1

    class Worker:
        incarnation = "old"

        @property
        def progress(self) -> Any:
            class Remote:
                @staticmethod
                async def remote() -> Progress:  # running, and never a token more
                    return Progress(EngineSnapshot(running=1, generation_tokens=5), worker.incarnation)
            return Remote()

    worker, pool, restarted = Worker(), Pool(), []
    watch = ColocatedWatch(pool, STALL_S, restarted.append, poll_s=0.01)  # type: ignore[arg-type]

    async def main() -> None:
        watch.start()
        try:
            async with asyncio.timeout(10):
                while not restarted:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(4 * STALL_S)  # the old process goes on answering
            assert not pool.routable and watch.events.readmitted == 0 and watch.events.stalled == 1
            worker.incarnation = "new"
            async with asyncio.timeout(10):
                while not pool.routable:
                    await asyncio.sleep(0.01)
        finally:
            await watch.close()

    asyncio.run(main())
    assert pool.failed == 1 and restarted == [worker]
    assert (watch.events.lost, watch.events.readmitted, watch.events.restarted) == (1, 1, 1)


def test_a_blocked_worker_with_no_work_is_left_alone(model_dir: Path) -> None:
    """An engine thread busy for 4 stall timeouts (a compile, a long load) with no request
    on it: not a stall; it is not restarted."""
    restarted: list[Any] = []
    backend, parts = cluster(model_dir, restarted)
    hang = Hang(parts["d1"])

    async def main() -> None:
        try:
            await backend.start()
            hang.start()
            await asyncio.sleep(4 * STALL_S)
        finally:
            hang.release()
            await backend.close()

    asyncio.run(main())
    assert backend.events.stalled == 0 and restarted == []


class FakeWorker:
    """A pool worker whose load poll answers `report`, hangs (`hang`), or fails as a dead
    Ray actor's call does (`dead`)."""

    def __init__(self, name: str, running: int = 0) -> None:
        self.name, self.running, self.seq = name, running, 0
        self.hang = self.dead = False

    @property
    def load(self) -> Any:
        worker = self

        class Remote:
            @staticmethod
            async def remote(since: object = None) -> Any:
                from ray.exceptions import ActorDiedError

                from pdserve.cluster.reports import LoadReport
                from pdserve.workers.messages import KVEventBatch
                from pdserve.workers.stats import EngineSnapshot

                if worker.dead:
                    raise ActorDiedError()
                if worker.hang:
                    await asyncio.sleep(3600)
                worker.seq += 1
                snap = EngineSnapshot(running=worker.running, generation_tokens=worker.seq, total_blocks=64,
                                      free_blocks=64)
                return LoadReport(snap, KVEventBatch(worker_id=worker.name, log_id="", first_seq=0, next_seq=0,
                                                     snapshot=True, events=()),
                                  "1-1")

        return Remote()


@pytest.mark.parametrize(("fault", "given_up"), [("hang", True), ("dead", False)])
def test_a_silent_worker_is_given_up_but_a_dead_one_is_left_to_ray(fault: str, given_up: bool) -> None:
    """Both stop answering with requests running at their last report. One whose poll
    hangs is given up and restarted; one whose poll fails as a dead actor's does is Ray's
    to restart (its load after a restart holds no request), so the watch leaves it."""
    workers = {"p0": FakeWorker("p0"), "d0": FakeWorker("d0", running=3), "d1": FakeWorker("d1")}
    restarted: list[Any] = []
    backend = DisaggregatedBackend({"p0": workers["p0"]}, {"d0": workers["d0"], "d1": workers["d1"]},  # type: ignore[dict-item]
                                   Router(RouterConfig(), BS), poll_s=0.01, stall_timeout_s=STALL_S,
                                   restart=restarted.append)

    async def main() -> None:
        try:
            await backend.start()
            await asyncio.sleep(0.05)
            setattr(workers["d0"], fault, True)
            await asyncio.sleep(4 * STALL_S)
        finally:
            await backend.close()

    asyncio.run(main())
    assert restarted == ([workers["d0"]] if given_up else [])
    assert backend.events.stalled == int(given_up) and "d0" in backend._dead
