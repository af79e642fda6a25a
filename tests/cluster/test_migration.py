"""A worker that dies mid-stream: its requests go on on another worker from the
tokens their clients already have. Real worker services (real engines, ZeroMQ
KV transport on loopback) in one process; a worker "dies" as a Ray actor does
for its callers: every call in flight fails at once, and so does every later
one (Ray's processes are killed for real in tests/chaos)."""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalActor, tiny_spec
from ray.exceptions import RayActorError

from pdserve import LLM, SamplingParams
from pdserve.cluster import worker_channel
from pdserve.cluster.actors import DecodeService, EngineService, PrefillService
from pdserve.cluster.backend import ColocatedBackend
from pdserve.cluster.backend_api import WorkerLostError
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.reports import LoadReport
from pdserve.cluster.router import Router, WorkerRole
from pdserve.cluster.router.policy import NoHealthyWorkerError, RouterConfig
from pdserve.workers.async_engine import RequestFaultError
from pdserve.workers.config import EngineConfig
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.tiny.builder import TinyModelSpec

BS = 16


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


_services: list[Any] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _services:
        _services.pop().close()


class MortalActor(LocalActor):
    """A `LocalActor` that can die: `kill()` fails its calls in flight and every later
    one with RayActorError (what Ray raises to an actor's callers when its process
    dies) and stops the service (its engine, its streams)."""

    def __init__(self, service: Any) -> None:
        super().__init__(service)
        self.dead = False
        self.service = service
        self._calls: set[asyncio.Future[Any]] = set()

    def kill(self) -> None:
        self.dead = True
        for call in list(self._calls):
            call.cancel()
        self.service.close()

    def restart(self, service: Any) -> None:
        """What Ray does to a dead actor: a new process behind the same handle."""
        self.service = service
        self.dead = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.service, name)
        actor = self

        class Remote:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future[Any]:
                fut = asyncio.ensure_future(actor._call(method, *args))
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # fire and forget is fine
                return fut

        return Remote()

    async def _call(self, method: Any, *args: Any) -> Any:
        if self.dead:
            raise RayActorError()
        task = asyncio.ensure_future(method(*args))
        self._calls.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if self.dead:
                raise RayActorError() from None
            raise
        finally:
            self._calls.discard(task)


def config(model_dir: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_model_len=1024, block_size=BS, max_num_batched_tokens=1024,
                        num_kv_blocks=512, **kw)


def disaggregated(model_dir: Path, num_decode: int = 2,
                  worker_wait_s: float = 10.0) -> tuple[DisaggregatedBackend, dict[str, MortalActor]]:
    base = config(model_dir)
    services: dict[str, Any] = {"p0": PrefillService(base, 1)}
    services.update({f"d{i}": DecodeService(base, 1, "127.0.0.1") for i in range(num_decode)})
    _services.extend(services.values())
    actors = {k: MortalActor(v) for k, v in services.items()}
    # Every prompt is handed off (no local prefill) unless the prefill worker is gone.
    router = Router(RouterConfig(local_prefill_threshold_tokens=0), BS)
    backend = DisaggregatedBackend({"p0": actors["p0"]}, {k: v for k, v in actors.items() if k != "p0"}, router,
                                   poll_s=0.01, worker_wait_s=worker_wait_s)
    return backend, actors


PROMPTS = [torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (40, 90, 33, 150, 61, 77, 20, 45)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=48, ignore_eos=True)


async def stream_all(backend: Any, params: list[SamplingParams], kill: Callable[[], Any] | None = None,
                     after_tokens: int = 0, prompts: list[list[int]] = PROMPTS,
                     concurrency: int = 4) -> list[list[int] | BaseException]:
    """Stream every prompt, `concurrency` at a time; `kill()` once the clients hold
    `after_tokens` tokens in all."""
    received = [0]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[int]:
        async with sem:
            tokens: list[int] = []
            async for out in backend.generate(f"r{i}", prompts[i], params[i], 60):
                tokens += out.outputs[0].token_ids
                received[0] += len(out.outputs[0].token_ids)
                await asyncio.sleep(0.002)  # a client that reads at its own pace
            return tokens

    async def killer() -> None:
        # Bounded: if the streams all end first, the fault never came, and the test fails
        # on that (an error here) rather than waiting for the suite's timeout.
        while received[0] < after_tokens:
            if all(t.done() for t in streams):
                raise AssertionError(f"every stream ended with {received[0]} tokens, before the "
                                     f"{after_tokens} the fault waited for")
            await asyncio.sleep(0.001)
        assert kill is not None
        kill()

    streams = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    tasks = list(streams)
    if kill is not None:
        tasks.append(asyncio.ensure_future(killer()))
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if kill is not None and isinstance(results[-1], BaseException):
            raise results[-1]
        return list(results[: len(prompts)])
    finally:
        await backend.close()


def offline(model_dir: Path, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    llm = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=512, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_decode_worker_death_mid_stream_loses_nothing(model_dir: Path) -> None:
    """d0 dies with requests mid-stream on it: each goes on on d1 from what its
    client has; greedy and seeded outputs equal a fault-free run, no token missing
    or repeated; the survivors hold no block after."""
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    backend, actors = disaggregated(model_dir)
    victim = actors["d0"]
    got = asyncio.run(stream_all(backend, params, victim.kill, after_tokens=60))
    assert got == offline(model_dir, params)
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.resumed_tokens > 0
    assert backend.events.lost == 1
    for name in ("p0", "d1"):
        engine = actors[name].service.engine
        assert engine.kv.pool.num_used == 0  # (a cached block nobody holds counts as free)
        assert not engine.has_unfinished_requests()
    assert actors["d1"].service.receiver.num_registered == 0


def test_a_decode_worker_that_loses_a_tensor_parallel_rank_loses_nothing(model_dir: Path) -> None:
    """d0 runs two tensor-parallel ranks (its KV re-sharded from a one-rank prefill worker); its
    second rank's process is killed mid-stream: d0's next step fails, its engine dies and the
    worker goes as a whole (under Ray its process exits, `_exit_soon`); each of its requests
    goes on on d1 from what its client has. Outputs equal a fault-free run; nothing is left."""
    base = config(model_dir)
    services: dict[str, Any] = {"p0": PrefillService(base, 1),
                                "d0": DecodeService(replace(base, tensor_parallel_size=2), 2, "127.0.0.1"),
                                "d1": DecodeService(base, 1, "127.0.0.1")}
    _services.extend(services.values())
    actors = {k: MortalActor(v) for k, v in services.items()}
    router = Router(RouterConfig(local_prefill_threshold_tokens=0), BS)
    backend = DisaggregatedBackend({"p0": actors["p0"]}, {k: actors[k] for k in ("d0", "d1")}, router, poll_s=0.01)
    rank = services["d0"].engine.tp_group.procs[0]
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]

    def kill_rank() -> None:
        loop = asyncio.get_running_loop()
        services["d0"].async_engine.on_dead = lambda error: loop.call_soon_threadsafe(actors["d0"].kill)
        rank.kill()  # a process this test's worker started, by its handle

    got = asyncio.run(stream_all(backend, params, kill_rank, after_tokens=60))
    assert rank.poll() is not None and services["d0"].async_engine.error is not None
    assert got == offline(model_dir, params)
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.resumed_tokens > 0
    for name in ("p0", "d1"):
        engine = actors[name].service.engine
        assert engine.kv.pool.num_used == 0  # (a cached block nobody holds counts as free)
        assert not engine.has_unfinished_requests()
    # Closed with its engine thread dead, the worker still stopped its ranks and left their group.
    assert not torch.distributed.is_initialized() and rank.poll() is not None


NAMED = {"type": "object", "properties": {"name": {"type": "string", "minLength": 12, "maxLength": 24},
                                          "id": {"type": "integer", "minimum": 100000, "maximum": 999999}},
         "required": ["name", "id"], "additionalProperties": False}


def test_a_grammar_survives_the_death_of_its_decode_worker(model_dir: Path) -> None:
    """Structured outputs across a migration: d0 dies mid-stream; each request goes on on d1,
    whose matcher replays what the client has: the answers equal a fault-free run and validate."""
    import json

    import jsonschema

    so = {"json": NAMED}
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so) if i % 2 else
              SamplingParams(temperature=0.9, seed=5, max_tokens=120, structured_outputs=so)
              for i in range(len(PROMPTS))]
    backend, actors = disaggregated(model_dir)
    got = asyncio.run(stream_all(backend, params, actors["d0"].kill, after_tokens=40))
    want = offline(model_dir, params)
    assert got == want
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.resumed_tokens > 0
    tok = actors["p0"].service.engine.tokenizer
    for tokens in want:
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), NAMED)
    engine = actors["d1"].service.engine
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_200_schemas_stay_valid_across_the_death_of_a_decode_worker(model_dir: Path) -> None:
    """Issue 48's validity bar across a migration: 200 random schemas (seed 48, as the other
    validity checks), greedy and sampled, 16 streams at a time; d0 dies mid-run. Every answer
    equals a fault-free run's and validates."""
    import json

    import jsonschema

    from pdserve.cluster.bench.schemas import schemas as random_schemas

    schemas = random_schemas(48, 200)
    prompts = [torch.randint(5, 4000, (8 + i % 24,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(len(schemas))]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=400,
                             structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    backend, actors = disaggregated(model_dir)
    got = asyncio.run(stream_all(backend, params, actors["d0"].kill, after_tokens=3000, prompts=prompts,
                                 concurrency=16))
    want = offline(model_dir, params, prompts)
    assert got == want
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.resumed_tokens > 0
    tok = actors["p0"].service.engine.tokenizer
    for s, tokens in zip(schemas, want):
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), s)
    assert not actors["d1"].service.engine.has_unfinished_requests()


def test_requests_fail_cleanly_once_every_decode_worker_is_gone(model_dir: Path) -> None:
    """No survivor, and none back within `worker_wait_s`: each request ends with one
    clean error (no hang, no Ray message)."""
    backend, actors = disaggregated(model_dir, num_decode=1, worker_wait_s=0.5)

    def kill_all() -> None:
        actors["d0"].kill()

    got = asyncio.run(asyncio.wait_for(stream_all(backend, [GREEDY] * len(PROMPTS), kill_all, after_tokens=30), 60))
    errors = [r for r in got if isinstance(r, BaseException)]
    assert errors, "some requests were running when the only decode worker died"
    # 503 (nowhere to go) for every request that was or would have been on it; never Ray's own error.
    assert all(isinstance(e, (NoHealthyWorkerError, WorkerLostError)) for e in errors), errors
    want = offline(model_dir, [GREEDY] * len(PROMPTS))
    assert all(r == w for r, w in zip(got, want) if not isinstance(r, BaseException))  # those done before it died


def test_requests_wait_for_the_only_decode_worker_to_come_back(model_dir: Path) -> None:
    """The only decode worker dies mid-stream and Ray restarts it 1.5 s later: its
    requests wait for it (`worker_wait_s`) and go on there from what their clients
    have; every output equals a fault-free run, none fails."""
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    backend, actors = disaggregated(model_dir, num_decode=1)
    victim = actors["d0"]

    def kill_then_restart() -> None:
        victim.kill()
        loop = asyncio.get_running_loop()
        loop.call_later(1.5, lambda: victim.restart(DecodeService(config(model_dir), 1, "127.0.0.1")))

    got = asyncio.run(asyncio.wait_for(stream_all(backend, params, kill_then_restart, after_tokens=60), 60))
    _services.append(victim.service)
    assert got == offline(model_dir, params)
    assert backend.streams.stats.migrations >= 1 and backend.streams.stats.exhausted == 0
    assert backend.events.lost == 1 and backend.events.readmitted == 1
    engine = victim.service.engine
    assert not engine.has_unfinished_requests() and victim.service.receiver.num_registered == 0


def test_colocated_worker_death_mid_stream_loses_nothing(model_dir: Path) -> None:
    workers = [EngineService(config(model_dir), 1, worker_name=f"w{i}") for i in range(2)]
    _services.extend(workers)
    actors = [MortalActor(w) for w in workers]
    backend = ColocatedBackend(actors)
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    got = asyncio.run(stream_all(backend, params, actors[0].kill, after_tokens=60))
    assert got == offline(model_dir, params)
    assert backend.streams.stats.migrations >= 1
    assert backend.health().status == "degraded"
    engine = workers[1].engine
    assert not engine.has_unfinished_requests()


def test_starts_a_worker_never_takes_move_on_and_lose_nothing(model_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker alive (its poll answers) whose inbox takes no start (lost on the way): each
    try sent there fails as a lost stream once its start is not reported taken, and runs on
    the other worker, token for token what the offline engine makes."""
    monkeypatch.setattr(worker_channel, "POLL_S", 0.2)
    monkeypatch.setattr(worker_channel, "START_CONFIRM_S", 1.0)
    workers = [EngineService(config(model_dir), 1, worker_name=f"w{i}") for i in range(2)]
    _services.extend(workers)
    dropped: list[str] = []
    monkeypatch.setattr(workers[0].inbox, "_start", lambda start: dropped.append(start.request.request_id))
    backend = ColocatedBackend([MortalActor(w) for w in workers])
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    got = asyncio.run(stream_all(backend, params))
    assert got == offline(model_dir, params)
    assert dropped and backend.streams.stats.migrations >= len(dropped)
    assert not workers[0].engine.has_unfinished_requests() and not workers[1].engine.has_unfinished_requests()


def test_handoffs_a_decode_worker_never_takes_move_on_and_lose_nothing(model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with disaggregated pools: d0's inbox takes no start; every try sent there
    goes on on d1, routed around d0 (alive: it stays in routing for other requests)."""
    monkeypatch.setattr(worker_channel, "POLL_S", 0.2)
    monkeypatch.setattr(worker_channel, "START_CONFIRM_S", 1.0)
    backend, actors = disaggregated(model_dir)
    dropped: list[str] = []
    monkeypatch.setattr(actors["d0"].service.inbox, "_start", lambda start: dropped.append(start.request.request_id))
    params = [GREEDY if i % 2 else SEEDED for i in range(len(PROMPTS))]
    got = asyncio.run(stream_all(backend, params))
    assert got == offline(model_dir, params)
    assert dropped and backend.streams.stats.migrations == len(dropped) and backend.events.lost == 0
    for name in ("p0", "d0", "d1"):
        engine = actors[name].service.engine
        assert engine.kv.pool.num_used == 0  # (a cached block nobody holds counts as free)
        assert not engine.has_unfinished_requests()


def test_health_stays_up_while_a_pool_role_can_be_served(model_dir: Path) -> None:
    """The only prefill worker gone: degraded (decode workers prefill locally), still 200;
    every decode worker gone: unavailable."""
    backend, actors = disaggregated(model_dir, num_decode=1)

    async def main() -> list[tuple[str, bool]]:
        seen = []
        await backend._refresh()
        seen.append((backend.health().status, backend.healthy))
        actors["p0"].kill()
        await backend._refresh()
        seen.append((backend.health().status, backend.healthy))
        tokens = [t async for out in backend.generate("x", PROMPTS[0], replace(GREEDY, max_tokens=4), 30)
                  for t in out.outputs[0].token_ids]
        assert len(tokens) == 4  # prefilled on the decode worker
        actors["d0"].kill()
        await backend._refresh()
        seen.append((backend.health().status, backend.healthy))
        await backend.close()
        return seen

    assert asyncio.run(main()) == [("ok", True), ("degraded", True), ("unavailable", False)]


def test_a_gap_in_a_workers_token_stream_moves_the_request_on_not_short() -> None:
    """A batch of the worker's deltas is lost on the way (its sequence number is
    missing): the try is broken though its call succeeded; the next try resumes
    from the tokens handed on, and the client gets every token once."""
    import zmq

    from pdserve.cluster.token_streams import TokenStreams
    from pdserve.workers.messages import TokenDelta, TokenDeltaBatch, encode
    from pdserve.workers.transfer import auth

    def delta(offset: int, tokens: tuple[int, ...], attempt: int, final: bool = False) -> TokenDelta:
        return TokenDelta("g", offset, tokens, "x" * len(tokens), "length" if final else None, None, None, 0, None,
                          None, None, None, attempt)

    class Pushing:
        def __init__(self, worker: str, batches: list[tuple[int, tuple[TokenDelta, ...]]]) -> None:
            self.worker, self.batches, self.seen = worker, batches, None

        async def call(self, req: Any) -> None:
            self.seen = req
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.connect(req.reply_to)
            for seq, deltas in self.batches:
                body = encode(TokenDeltaBatch(worker_id=self.worker, seq=seq, deltas=deltas))
                sock.send_multipart([auth.token_tag(auth.default_secret(), req.reply_to, body), body])
            await asyncio.sleep(0.1)
            sock.close(linger=1000)

        def abort(self, request_id: str) -> None:
            pass

    first = Pushing("w1", [(0, (delta(0, (1, 2), 0),)),  # seq 1, carrying token 3, never arrives
                           (2, (delta(3, (4,), 0),))])
    second = Pushing("w2", [(0, (delta(2, (3, 4, 5), 1, final=True),))])
    tries = iter([first, second])

    async def run() -> list[int]:
        streams = TokenStreams("127.0.0.1")
        try:
            req = streams.request("g", [7, 8], SamplingParams(max_tokens=5), 10.0)
            outs = [o async for o in streams.run(req, lambda r, failed: next(tries))]
            assert streams.collector.num_gaps == 1 and streams.stats.migrations == 1
            return [t for o in outs for t in o.outputs[0].token_ids]
        finally:
            await streams.close()

    assert asyncio.run(run()) == [1, 2, 3, 4, 5]
    assert second.seen is not None and second.seen.resume.token_ids == (1, 2) and second.seen.attempt == 1


def test_a_worker_whose_engine_thread_dies_exits_to_be_restarted(model_dir: Path, tmp_path: Path) -> None:
    """An engine-thread crash (injected, as a bug would raise) leaves no zombie: the
    worker's requests fail, then its process exits (Ray restarts it). Fault
    injection is refused unless the worker was started with it on."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, os, sys
        from pdserve.cluster.actors import EngineService
        from pdserve.workers.config import EngineConfig
        cfg = EngineConfig(model={str(model_dir)!r}, max_model_len=256, num_kv_blocks=64)
        svc = EngineService(cfg, 1, worker_name="w", exit_on_engine_death=True)

        async def main():
            state = await svc.drain_state()
            assert state.drained, state
            os.environ.pop("PDSERVE_FAULT_INJECTION")
            try:
                await svc.inject_fault("engine_crash")
            except PermissionError:
                print("refused", flush=True)
            os.environ["PDSERVE_FAULT_INJECTION"] = "1"
            await svc.inject_fault("engine_crash")
            await asyncio.sleep(30)  # the exit comes well before
            print("still alive", flush=True)

        asyncio.run(main())
    """))
    env = {**os.environ, "PDSERVE_FAULT_INJECTION": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert "refused" in proc.stdout and "still alive" not in proc.stdout
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert "engine thread failed" in proc.stderr


def test_a_request_that_breaks_its_row_is_not_moved_to_another_worker(model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The poison-pill rule: a request whose row raises in every engine (what a top_k past
    int64 did to a decode worker's engine thread) fails alone once, with RequestFaultError,
    and is never moved to the other decode worker; the rest of the load is whole."""
    backend, actors = disaggregated(model_dir)
    for actor in actors.values():
        runner = actor.service.engine.runner
        monkeypatch.setattr(runner, "_sampling_batch", _raising_for("r3", runner._sampling_batch))
    results = asyncio.run(stream_all(backend, [GREEDY] * len(PROMPTS)))
    want = offline(model_dir, [GREEDY] * len(PROMPTS))
    assert isinstance(results[3], RequestFaultError), results[3]
    assert [r for i, r in enumerate(results) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    stats = backend.streams.stats
    assert stats.faulted == 1 and stats.migrations == 0
    faults = {name: a.service.engine.stats.request_faults for name, a in actors.items()}
    assert faults["p0"] == 1 and faults["d0"] + faults["d1"] == 1, faults  # the decode worker computed it itself
    assert all(a.service.engine.kv.pool.num_used == 0 for a in actors.values())


def _raising_for(request_id: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def sampling_batch(reqs: Any, *rest: Any) -> Any:
        if any(r.request_id == request_id for r in reqs):
            raise OverflowError("Overflow when unpacking long long")
        return real(reqs, *rest)

    return sampling_batch


class _Reporting:
    """A worker that answers the backend's load polls (routing needs them) and nothing else."""

    def __init__(self, name: str, role: WorkerRole) -> None:
        self.name, self.role = name, role

    async def load(self, since: object = None) -> LoadReport:
        return LoadReport(EngineSnapshot(free_blocks=64, total_blocks=64),
                          KVEventBatch(worker_id=self.name, log_id="", first_seq=0, next_seq=0, snapshot=True,
                                       events=()), "1", self.role, False, 0)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_placed_try_is_aborted_by_its_own_number_before_its_call_runs(mode: str) -> None:
    """A migrated try is placed, and its client goes in the same turn, before the try's call
    runs. The abort must name that try: a worker drops only the try an abort names (an
    earlier try's abort ends nothing newer), and a start whose abort came first is never
    sent (cluster/worker_channel.py). Named as try 0, the try would run to its end for no
    one, holding its blocks."""
    req = ServeRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), 10.0, "tcp://127.0.0.1:1", attempt=2)
    sent: list[tuple[object, str, int]] = []

    async def place() -> Any:
        if mode == "colocated":
            backend: Any = ColocatedBackend([object(), object()])
        else:
            backend = DisaggregatedBackend({"p0": LocalActor(_Reporting("p0", WorkerRole.PREFILL))},
                                           {"d0": LocalActor(_Reporting("d0", WorkerRole.DECODE))},
                                           Router(RouterConfig(local_prefill_threshold_tokens=0), 16))
            await backend._refresh()
        backend.abort_on = lambda where, rid, attempt: sent.append((where, rid, attempt))
        placement = backend._place(req, None)
        placement.abort("r")
        return placement

    asyncio.run(place())
    assert sent and all(attempt == 2 for _, _, attempt in sent), sent


def _final_delta(rid: str, offset: int, tokens: tuple[int, ...], attempt: int, final: bool) -> Any:
    from pdserve.workers.messages import TokenDelta

    return TokenDelta(rid, offset, tokens, "x" * len(tokens), "length" if final else None, None, None, 0, None,
                      None, None, None, attempt)


def test_a_worker_lost_just_after_its_final_delta_starts_no_next_try() -> None:
    """The worker's final delta is handed on in the same moment its call fails (the worker
    died, or was given up, right after sending it): the client has every token, so the
    request is over; a next try would run on another worker for no one (nothing aborts a
    request that finished), holding its blocks to max_tokens or the deadline."""
    from pdserve.cluster.token_streams import TokenStreams

    started: list[int] = []

    async def main() -> list[int]:
        streams = TokenStreams("127.0.0.1")
        coll = streams.collector

        class Dies:
            async def call(self, req: Any) -> None:
                started.append(req.attempt)
                entry = coll._open[req.request_id]
                coll._accept(entry, _final_delta(req.request_id, 0, (1, 2), 0, False))
                await asyncio.sleep(0.05)
                loop = asyncio.get_running_loop()  # the reader hands the final delta on in this turn
                loop.call_soon(coll._accept, entry, _final_delta(req.request_id, 2, (3,), 0, True))
                raise RayActorError()

            def abort(self, request_id: str) -> None:
                pass

        class Next(Dies):
            async def call(self, req: Any) -> None:
                started.append(req.attempt)  # (a channel's run returns at once: `finished` is set)

        tries = iter([Dies(), Next()])
        try:
            req = streams.request("g", [7, 8], SamplingParams(max_tokens=3), 10.0)
            tokens: list[int] = []
            async for out in streams.run(req, lambda r, failed: next(tries)):
                tokens += out.outputs[0].token_ids
                await asyncio.sleep(0.2)  # the client takes a moment to read each chunk
            await asyncio.sleep(0.1)
            assert streams.stats.migrations == 0
            return tokens
        finally:
            await streams.close()

    assert asyncio.run(main()) == [1, 2, 3]
    assert started == [0], "a try was started after the request finished"


def test_a_move_that_finds_no_worker_is_not_counted_as_a_migration() -> None:
    from pdserve.cluster.token_streams import TokenStreams

    async def main() -> None:
        streams = TokenStreams("127.0.0.1", worker_wait_s=0.2)
        started: list[int] = []

        class Dies:
            async def call(self, req: Any) -> None:
                started.append(req.attempt)
                raise RayActorError()

            def abort(self, request_id: str) -> None:
                pass

        def place(req: Any, failed: Any) -> Any:
            if failed is None and not started:
                return Dies()
            raise NoHealthyWorkerError("colocated")

        req = streams.request("g", [7, 8], SamplingParams(max_tokens=3), 10.0)
        try:
            with pytest.raises(NoHealthyWorkerError):
                async for _ in streams.run(req, place):
                    pass
        finally:
            await streams.close()
        assert started == [0] and streams.stats.migrations == 0 and streams.stats.resumed_tokens == 0

    asyncio.run(main())


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_gateway_replicas_spread_requests_over_every_colocated_worker(replicas: int) -> None:
    """Each replica counts only its own requests in flight, so at low load every worker is a
    tie: broken from worker 0 by every replica, two replicas' four requests each went to
    workers 0-3 of 8, and the other four sat idle."""
    workers = 8
    backends = [ColocatedBackend([object() for _ in range(workers)], replica=(r, replicas)) for r in range(replicas)]
    req = ServeRequest("r", (1, 2, 3), SamplingParams(max_tokens=8), 60.0, "tcp://127.0.0.1:1")
    used: collections.Counter[int] = collections.Counter()
    for i in range(workers):
        backend = backends[i % replicas]
        placed = backend._place(req, None)
        backend._in_flight[placed.index] += 1  # as serve_on counts it while it runs
        used[placed.index] += 1
    assert sorted(used) == list(range(workers)), f"requests per worker {dict(used)}"
