"""The gateway's fault-tolerance metrics (GET /metrics): `pdserve:worker_up`, restarts, lost
links and migrations follow the disaggregated backend's own counters as workers stop
answering, restart in a new process, or switch pools, with no stale series left behind."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from factories import LocalActor
from metrics_store import parse, sample
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.router import Router, RouterConfig
from pdserve.cluster.worker_metrics import Pool, WorkerMetrics
from pdserve.workers.sampling_params import SamplingParams

MODEL = "tiny"


class _PolledWorker:
    """Answers the disaggregated backend's polls, or fails them while `down`; a new
    `incarnation` is a restarted process."""

    def __init__(self, name: str) -> None:
        self.name, self.down, self.seq, self.incarnation = name, False, 0, "1"

    async def load(self, since: object = None) -> Any:
        from pdserve.cluster.reports import LoadReport
        from pdserve.workers.messages import KVEventBatch
        from pdserve.workers.stats import EngineSnapshot

        if self.down:
            raise RuntimeError(f"{self.name} is down")
        self.seq += 1
        return LoadReport(EngineSnapshot(free_blocks=64, total_blocks=64),
                          KVEventBatch(worker_id=self.name, log_id="", first_seq=0, next_seq=0,
                                       snapshot=True, events=()), self.incarnation)


class _Pushing:
    """A try that sends its worker's token-delta batches straight to the gateway's stream."""

    def __init__(self, worker: str, batches: list[tuple[int, tuple[Any, ...]]]) -> None:
        self.worker, self.batches = worker, batches

    async def call(self, req: Any) -> None:
        import zmq

        from pdserve.workers.messages import TokenDeltaBatch, encode
        from pdserve.workers.transfer import auth

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(req.reply_to)
        for seq, deltas in self.batches:
            body = encode(TokenDeltaBatch(worker_id=self.worker, seq=seq, deltas=deltas))
            sock.send_multipart([auth.token_tag(auth.default_secret(), req.reply_to, body), body])  # signed
        await asyncio.sleep(0.1)
        sock.close(linger=1000)

    def abort(self, request_id: str) -> None:
        pass


class _Dying:
    """A try whose worker dies at once."""

    async def call(self, req: Any) -> None:
        from ray.exceptions import RayActorError

        raise RayActorError()

    def abort(self, request_id: str) -> None:
        pass


def _delta(rid: str, offset: int, tokens: tuple[int, ...], attempt: int, final: bool = False) -> Any:
    from pdserve.workers.messages import TokenDelta

    return TokenDelta(rid, offset, tokens, "x" * len(tokens), "length" if final else None, None, None, 0, None,
                      None, None, None, attempt)


def test_reliability_metrics_follow_the_backends_counters() -> None:
    """Pools, health state, worker events, migrations and token-stream gaps of a real
    DisaggregatedBackend (workers that stop answering and come back restarted; tries
    that break on a gap, hear stale deltas, and run out), as the gateway exports them."""
    from pdserve.cluster.backend_api import WorkerLostError
    from pdserve.cluster.disagg_backend import DisaggregatedBackend

    p0, d0, d1 = _PolledWorker("p0"), _PolledWorker("d0"), _PolledWorker("d1")
    backend = DisaggregatedBackend({"p0": LocalActor(p0)}, {"d0": LocalActor(d0), "d1": LocalActor(d1)},
                                   Router(RouterConfig(), 16))
    gw = Gateway(backend, None, GatewayConfig(model_name=MODEL, max_model_len=256))

    async def scrape() -> dict[str, Any]:
        return parse((await gw.metrics.exposition({})).decode())

    def pools(f: dict[str, Any]) -> dict[str, tuple[float, float]]:
        return {s.labels["pool"]: (s.value, sample(f, "pdserve:pool_workers_configured", pool=s.labels["pool"]))
                for s in f["pdserve:pool_workers_live"].samples}

    def state(f: dict[str, Any]) -> str:
        (on,) = [s.labels["state"] for s in f["pdserve:health_state"].samples if s.value == 1]
        assert len(f["pdserve:health_state"].samples) == 3
        return on

    def expected_pools() -> dict[str, tuple[float, float]]:
        return {name: (p.live, p.total) for name, p in backend.health().pools.items()}

    async def scrape_health() -> dict[str, Any]:
        """A scrape, checked against the backend's own `health()` then."""
        f = await scrape()
        assert pools(f) == expected_pools() and state(f) == backend.health().status
        return f

    async def main() -> list[dict[str, Any]]:
        seen = []
        await backend._refresh()
        seen.append(await scrape_health())
        assert backend.streams._collector is None, "a scrape must not start the token stream"
        d1.down = True
        await backend._refresh()
        seen.append(await scrape_health())
        d0.down = True
        await backend._refresh()
        seen.append(await scrape_health())
        d0.down, d1.down, d1.incarnation = False, False, "2"
        await backend._refresh()
        f = await scrape_health()
        events = backend.events
        assert (events.lost, events.readmitted, events.restarted) == (2, 2, 1)
        assert sample(f, "pdserve:workers_lost_total") == events.lost
        assert sample(f, "pdserve:workers_readmitted_total") == events.readmitted
        assert sample(f, "pdserve:workers_restarted_total") == events.restarted

        # Request g: its first try's batch 1 never arrives (a gap): it moves on from 2 tokens;
        # its second try hears a late delta of the first (stale). Request h: every try's worker
        # dies, until the last allowed one.
        streams = backend.streams
        tries = iter([_Pushing("w1", [(0, (_delta("g", 0, (1, 2), 0),)), (2, (_delta("g", 3, (4,), 0),))]),
                      _Pushing("w2", [(0, (_delta("g", 2, (9,), 0), _delta("g", 2, (3, 4, 5), 1, final=True)))])])
        req = streams.request("g", [7, 8], SamplingParams(max_tokens=5), 10.0)
        tokens = [t async for o in streams.run(req, lambda r, failed: next(tries)) for t in o.outputs[0].token_ids]
        assert tokens == [1, 2, 3, 4, 5]
        with pytest.raises(WorkerLostError):
            async for _ in streams.run(streams.request("h", [7, 8], SamplingParams(max_tokens=5), 10.0),
                                       lambda r, failed: _Dying()):
                pass
        f = await scrape()
        stats, collector = streams.stats, streams.collector
        truth = {"request_migrations": stats.migrations, "request_migration_resumed_tokens": stats.resumed_tokens,
                 "request_migrations_exhausted": stats.exhausted, "token_stream_gaps": collector.num_gaps,
                 "token_stream_stale_deltas": collector.num_stale, "token_stream_diverged": collector.num_diverged}
        # g moved once (2 tokens resumed); h moved twice (max_migrations) and ran out.
        assert truth == {"request_migrations": 3, "request_migration_resumed_tokens": 2,
                         "request_migrations_exhausted": 1, "token_stream_gaps": 1, "token_stream_stale_deltas": 1,
                         "token_stream_diverged": 0}
        for name, value in truth.items():
            assert sample(f, f"pdserve:{name}_total") == value, name
        await backend.close()
        return seen

    ok, degraded, unavailable = asyncio.run(main())
    assert state(ok) == "ok" and pools(ok) == {"prefill": (1, 1), "decode": (2, 2)}
    assert state(degraded) == "degraded" and pools(degraded) == {"prefill": (1, 1), "decode": (1, 2)}
    assert state(unavailable) == "unavailable" and pools(unavailable)["decode"] == (0, 2)
    assert sample(degraded, "pdserve:workers_lost_total") == 1
    for name in ("request_migrations", "request_migration_resumed_tokens", "request_migrations_exhausted",
                 "token_stream_gaps", "token_stream_stale_deltas", "token_stream_diverged"):
        assert sample(ok, f"pdserve:{name}_total") == 0, name


def test_a_worker_that_switched_pools_leaves_no_stale_worker_up_series() -> None:
    """A role switch moves a worker's name from one pool to the other (and, while it switches,
    out of both). Its old series must go: a stale 0 would hold the critical worker-down alert
    (`worker_up == 0`) for as long as the gateway runs, a stale 1 count it twice."""
    from pdserve.cluster.metrics import GatewayMetrics

    class Handle:
        def __init__(self, pool: Pool, fail: bool) -> None:
            async def remote() -> str:
                if fail:
                    raise RuntimeError("no answer")
                return WorkerMetrics(pool, "pdserve-prefill-0").render()

            self.metrics = type("M", (), {"remote": staticmethod(remote)})()

    def up(text: bytes) -> dict[tuple[str, str], float]:
        return {(s.labels["pool"], s.labels["worker"]): s.value for f in text_string_to_metric_families(text.decode())
                for s in f.samples if s.name == "pdserve:worker_up"}

    async def main() -> list[dict[tuple[str, str], float]]:
        m = GatewayMetrics()
        before = await m.exposition({"pdserve-prefill-0": ("prefill", Handle("prefill", fail=True))})
        during = await m.exposition({})
        after = await m.exposition({"pdserve-prefill-0": ("decode", Handle("decode", fail=False))})
        return [up(before), up(during), up(after)]

    before, during, after = asyncio.run(main())
    assert before == {("prefill", "pdserve-prefill-0"): 0.0}
    assert during == {}
    assert after == {("decode", "pdserve-prefill-0"): 1.0}
