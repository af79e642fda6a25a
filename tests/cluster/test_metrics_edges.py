"""Edge cases of the gateway's metrics an operator's SLO dashboards and alerts rely on:
counters that never go backwards within a series, whichever gateway replica a scrape reaches."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import metrics_peers
from pdserve.cluster.metrics import GatewayMetrics, _render


class _Store:
    """Ray's key-value store as a dict (what every replica of a deployment shares)."""

    def __init__(self) -> None:
        self.values: dict[int, bytes] = {}

    def put(self, rank: int, payload: bytes) -> None:
        self.values[rank] = payload

    def get(self, rank: int) -> bytes | None:
        return self.values.get(rank)


def _by_replica(text: bytes, name: str) -> dict[str, float]:
    return {s.labels.get("replica", ""): s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == name}


def test_a_counter_never_goes_back_when_scrapes_alternate_between_replicas() -> None:
    """HAProxy sends consecutive scrapes to different replicas. Replica 0's series must read the
    same or more on each: a drop is a counter reset to rate(), which then counts the whole
    counter again (a spike of invented traffic on the dashboard, alerts on it)."""
    store = _Store()
    tier = [GatewayMetrics(replica=r, replicas=2) for r in range(2)]
    for m in tier:
        m.peers = store
    m0, m1 = tier

    async def scrapes() -> list[float]:
        # Replica 0's publisher ran a moment ago (as it does every PUBLISH_S) ...
        store.put(0, metrics_peers.pack(_render([m0.own_families()]), time.time()))
        m0.prompt_tokens.inc(3)  # ... then it admitted a request.
        seen = []
        for m in (m0, m1, m0, m1):  # Prometheus, through HAProxy, one scrape after the other
            seen.append(_by_replica(await m.exposition({}), "pdserve:prompt_tokens_total")["0"])
        return seen

    seen = asyncio.run(scrapes())
    assert seen[0] == 3.0
    assert all(a <= b for a, b in zip(seen, seen[1:])), f"replica 0's counter went back: {seen}"
