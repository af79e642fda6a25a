"""Several gateway replicas behind one scrape (cluster/metrics_peers.py): HAProxy sends each
scrape to one replica, so each replica's /metrics must carry every replica's own families,
labelled by replica, or one series takes its values from whichever replica answered (each
drop a counter reset to rate(), an alert on an event long past)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from metrics_store import Store, by_replica
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import metrics_peers
from pdserve.cluster.metrics import GatewayMetrics, _render


def _tier(store: Store) -> list[GatewayMetrics]:
    tier = [GatewayMetrics(replica=r, replicas=2) for r in range(2)]
    for m in tier:
        m.peers = store
    return tier


def test_each_replicas_counters_reach_every_scrape_under_their_own_label() -> None:
    store = Store()
    m0, m1 = _tier(store)
    m0.prompt_tokens.inc(3)
    m1.prompt_tokens.inc(5)
    m1.success.labels("stop").inc(2)

    async def scrape() -> tuple[bytes, bytes]:
        for m in (m0, m1):  # what each replica's publisher does every PUBLISH_S
            store.put(m.replica, metrics_peers.pack(_render([m.own_families()]), time.time()))
        return await m0.exposition({}), await m1.exposition({})

    for text in asyncio.run(scrape()):  # whichever replica a scrape reaches: the same series, the same values
        assert by_replica(text, "pdserve:prompt_tokens_total") == {"0": 3.0, "1": 5.0}
        stops = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text.decode())
                 for s in f.samples if s.name == "pdserve:request_success_total"
                 and s.labels["finished_reason"] == "stop"}
        assert stops == {"0": 0.0, "1": 2.0}


def test_a_replica_gone_for_good_leaves_no_frozen_series() -> None:
    store = Store()
    m0, m1 = _tier(store)
    m1.prompt_tokens.inc(5)
    store.put(1, metrics_peers.pack(_render([m1.own_families()]), time.time() - metrics_peers.STALE_S - 1))
    text = asyncio.run(m0.exposition({}))
    assert by_replica(text, "pdserve:prompt_tokens_total") == {"0": 0.0}


def test_one_replica_alone_is_unlabelled_and_publishes_nothing() -> None:
    m = GatewayMetrics()
    m.prompt_tokens.inc(4)
    assert by_replica(asyncio.run(m.exposition({})), "pdserve:prompt_tokens_total") == {"": 4.0}


def test_a_replica_publishes_its_families_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_peers, "PUBLISH_S", 0.05)
    store = Store()
    m0, _ = _tier(store)

    async def run() -> None:
        m0.start_publishing()
        try:
            m0.prompt_tokens.inc(7)
            await asyncio.sleep(0.3)
        finally:
            await m0.close()

    asyncio.run(run())
    families = metrics_peers.unpack(store.values[0], time.time())
    assert families is not None
    assert {s.labels["replica"]: s.value for f in families for s in f.samples
            if s.name == "pdserve:prompt_tokens_total"} == {"0": 7.0}


class _Worker:
    """A worker handle whose `metrics.remote()` answers (a minimal exposition) or fails."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers

        async def remote() -> bytes:
            if not self.answers:
                raise RuntimeError("no answer")
            return b"# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{pool=\"decode\"," \
                   b"worker=\"pdserve-decode-0\"} 0.0\n"

        self.metrics = type("M", (), {"remote": staticmethod(remote)})()


def test_a_worker_back_up_reads_up_whichever_replica_answers() -> None:
    """worker_up is what the answering replica's fetch just saw. A replica that last fetched
    while the worker was down published its 0, and went on republishing it every PUBLISH_S while
    scrapes reached the other replica: the critical PdserveWorkerDown (`worker_up == 0`) held
    on a worker that was back, for as long as that replica got no scrape."""
    store = Store()
    m0, m1 = _tier(store)
    worker = _Worker(answers=False)

    async def run() -> bytes:
        workers = {"pdserve-decode-0": ("decode", worker)}
        await m1.exposition(workers)  # a scrape reaches replica 1 while the worker is down
        worker.answers = True
        await m1._publish()  # replica 1's publisher, every PUBLISH_S
        return await m0.exposition(workers)  # the next scrapes reach replica 0

    text = asyncio.run(run())
    up = [(s.labels, s.value) for f in text_string_to_metric_families(text.decode()) for s in f.samples
          if s.name == "pdserve:worker_up"]
    assert up == [({"pool": "decode", "worker": "pdserve-decode-0"}, 1.0)]


class _HungStore(Store):
    """Ray's key-value store while the GCS does not answer: every call blocks until `answer` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()

    def put(self, rank: int, payload: bytes) -> None:
        self.answer.wait(30)
        super().put(rank, payload)

    def get(self, rank: int) -> bytes | None:
        self.answer.wait(30)
        return super().get(rank)


def test_a_scrape_answers_in_time_while_the_peers_store_hangs() -> None:
    """The store's calls had no deadline: while the GCS did not answer (Ray's client waits up to
    a minute for it to come back), every scrape of the gateway hung past Prometheus' scrape
    timeout (PdserveGatewayDown, critical, on a gateway that served), and the scrapes after it
    waited on the same hung fetch. A scrape gives the store its deadline, then answers with
    what it has: its own families and the workers'."""
    store = _HungStore()
    m0, _ = _tier(store)
    m0.prompt_tokens.inc(3)

    async def scrape_twice() -> list[bytes]:
        try:
            async with asyncio.timeout(5):  # each waits 0.2 s on the put and 0.2 s on the get
                return [await m0.exposition({}, deadline_s=0.2) for _ in range(2)]
        finally:
            store.answer.set()  # the store's threads end (asyncio.run waits for them)

    for text in asyncio.run(scrape_twice()):
        assert by_replica(text, "pdserve:prompt_tokens_total") == {"0": 3.0}
