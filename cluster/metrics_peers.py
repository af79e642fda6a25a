"""Every gateway replica's own metrics in any replica's /metrics.

Prometheus scrapes the gateway through HAProxy, which sends each scrape to one replica. Each
replica counts its own requests: without this, one series took its values from whichever
replica a scrape reached, each drop between them read as a counter reset (rate() invented
traffic, an alert fired on an event long past), or the dashboard saw one replica's share.
With several replicas, each labels its gateway families `replica="<rank>"` and publishes them
every PUBLISH_S to a store all replicas share (Ray's internal key-value store, in the GCS);
a replica's /metrics is its own families, fresh (and published before the scrape answers,
so the next scrape, on any replica, reads no less), the others' last published ones (up to
PUBLISH_S old; dropped past STALE_S: a replica gone for good leaves no frozen series), and
the workers' (with `pdserve:worker_up`, what this scrape's fetch of them saw: never
published). One replica alone changes nothing: no label, no store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PUBLISH_S = 5.0  # how often a replica publishes its families
STALE_S = 30.0  # a peer's families older than this are left out (it is gone, or cannot publish)
STORE_DEADLINE_S = 2.0  # the longest a scrape or a publish waits on one call of the store
REPLICA_LABEL = "replica"
_NAMESPACE = "pdserve-gateway-metrics"
T = TypeVar("T")
# The store's calls block (Ray's client waits up to a minute for a GCS that does not answer): on a
# thread of their own, a hung call holds that one thread, not the loop's default executor, which
# renders every scrape; the calls after it queue behind it, each waited on for its deadline only.
_store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-metrics-store")


class PeerStore(Protocol):
    """Where replicas leave their families for each other (blocking calls: run off the loop)."""

    def put(self, rank: int, payload: bytes) -> None: ...

    def get(self, rank: int) -> bytes | None: ...


class RayKVStore:
    """Ray's internal key-value store: every replica of the deployment reaches the same GCS."""

    def put(self, rank: int, payload: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(f"replica-{rank}", payload, overwrite=True, namespace=_NAMESPACE)

    def get(self, rank: int) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(f"replica-{rank}", namespace=_NAMESPACE)
        return value if isinstance(value, bytes) else None


def labelled(families: Iterable[Metric], rank: int) -> list[Metric]:
    """Copies of `families` whose every sample carries `replica="<rank>"`."""
    out = []
    for fam in families:
        copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        copy.samples = [s._replace(labels={**s.labels, REPLICA_LABEL: str(rank)}) for s in fam.samples]
        out.append(copy)
    return out


def pack(text: bytes, now: float) -> bytes:
    return f"{now!r}\n".encode() + text


def unpack(payload: bytes, now: float) -> list[Metric] | None:
    """A peer's families, or None when its payload is older than STALE_S or unreadable."""
    head, _, text = payload.partition(b"\n")
    try:
        if now - float(head) > STALE_S:
            return None
        return list(text_string_to_metric_families(text.decode()))
    except ValueError as e:
        log.warning("a gateway replica's published metrics are unreadable (%s); left out", e)
        return None


async def in_store_thread(call: Callable[[], T], deadline_s: float = STORE_DEADLINE_S) -> T:
    """`call()` (the store's, blocking) on the store's thread, waited on for `deadline_s` at most:
    TimeoutError then (the call goes on, on that thread). Without a deadline, a GCS that did not
    answer held every scrape past Prometheus' scrape timeout: the gateway read as down."""
    async with asyncio.timeout(deadline_s):
        return await asyncio.get_running_loop().run_in_executor(_store_thread, call)


async def read_peers(store: PeerStore, rank: int, replicas: int,
                     deadline_s: float = STORE_DEADLINE_S) -> list[list[Metric]]:
    """The other replicas' fresh families (off the event loop: the store's calls block); none
    when the store does not answer within `deadline_s`."""
    def read() -> list[list[Metric]]:
        now = time.time()
        out = []
        for peer in range(replicas):
            if peer == rank:
                continue
            try:
                payload = store.get(peer)
            except Exception as e:  # noqa: BLE001 - the GCS unreachable: this scrape has our own, and the workers'
                log.warning("reading gateway replica %d's metrics failed: %r", peer, e)
                continue
            families = unpack(payload, now) if payload is not None else None
            if families is not None:
                out.append(families)
        return out

    try:
        return await in_store_thread(read, deadline_s)
    except TimeoutError:
        log.warning("the gateway replicas' metrics store did not answer within %.1f s; this scrape has only "
                    "this replica's own metrics, and the workers'", deadline_s)
        return []


async def publish_forever(publish: Callable[[], Awaitable[object]]) -> None:
    """Every PUBLISH_S, `publish()` (this replica's labelled families into the store: the
    gateway's, which orders its puts with its scrapes')."""
    while True:
        try:
            await publish()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the next round tries again; a scrape here still has ours
            log.warning("publishing this gateway replica's metrics failed: %r", e)
        await asyncio.sleep(PUBLISH_S)


async def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


__all__ = ["PUBLISH_S", "REPLICA_LABEL", "STALE_S", "STORE_DEADLINE_S", "PeerStore", "RayKVStore", "in_store_thread",
           "labelled", "pack", "publish_forever", "read_peers", "stop", "unpack"]
