"""A stop's drain (cluster/shutdown.py `_drain`): the requests in flight get up to DRAIN_S to
finish, read from the gateway's in-flight count; what the drain does when a read fails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from pdserve.cluster import drain_flag, shutdown


def _drain(monkeypatch: pytest.MonkeyPatch, readings: Iterator[float | None], replicas: int = 1) -> float:
    """Seconds from the drain's start to its stop signal, the gateway's count read from `readings`
    (a /metrics holding the counts of `replicas` gateway replicas)."""
    monkeypatch.setattr(drain_flag, "raise_flag", lambda port, gcs=True: None)
    monkeypatch.setattr(shutdown, "DRAIN_S", 2.0)

    def read(cfg: object) -> shutdown.Reading | None:
        n = next(readings)
        return None if n is None else shutdown.Reading(n, replicas)

    monkeypatch.setattr(shutdown, "in_flight", read)
    stopped: list[float] = []
    monkeypatch.setattr(shutdown.os, "kill", lambda pid, sig: stopped.append(time.monotonic()))
    t0 = time.monotonic()
    shutdown._drain(SimpleNamespace(port=1))  # type: ignore[arg-type]
    assert len(stopped) == 1
    return stopped[0] - t0


def test_a_read_that_fails_after_one_that_counted_streams_does_not_end_the_drain(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker slow to answer its metrics made the gateway's /metrics slower than the drain's
    read: the read failed, the drain took that for "no gateway" and stopped at once, cutting
    every open stream instead of giving them DRAIN_S."""
    def readings() -> Iterator[float | None]:
        yield 3.0
        while True:
            yield None

    assert _drain(monkeypatch, readings()) >= 1.9
    assert "3 request(s) still in flight" in capsys.readouterr().err


def test_the_drain_ends_once_nothing_is_in_flight_or_no_gateway_ever_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _drain(monkeypatch, iter([2.0, 1.0, 0.0, 0.0, 5.0])) < 1.5  # idle twice: done
    assert _drain(monkeypatch, iter([None, 4.0])) < 0.5  # nothing to wait for



def test_a_request_admitted_before_the_gateway_read_the_flag_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway reads the drain flag every drain_flag.POLL_S and admits requests until it has.
    The drain took two reads of 0, 0.25 s apart, for done: it stopped 0.5 s after raising the
    flag, its last read at 0.25 s; a request admitted at 0.35 s (the gateway had not read the
    flag yet) was cut by Serve's shutdown, its client given no response."""
    arrives, ends = 0.35, 1.2  # in flight from 0.35 s to 1.2 s after the flag went up

    def readings() -> Iterator[float | None]:
        t0 = time.monotonic()
        while True:
            yield 1.0 if arrives <= time.monotonic() - t0 < ends else 0.0

    assert arrives < drain_flag.POLL_S  # admitted: the gateway had not read the flag yet
    assert _drain(monkeypatch, readings()) >= ends


def test_with_several_gateway_replicas_a_peers_request_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several gateway replicas, the /metrics the drain reads is one replica's: the others'
    counts in it are what they last published (cluster/metrics_peers.py, every PUBLISH_S). A
    request another replica admitted just before it read the flag showed at that replica's next
    publish only: the drain had read 0 twice by then and stopped, cutting it."""
    from pdserve.cluster import metrics_peers

    monkeypatch.setattr(metrics_peers, "PUBLISH_S", 1.0)
    published, ends = 1.0, 1.5  # admitted at 0.3 s on a peer, which publishes at 1.0 s

    def readings() -> Iterator[float | None]:
        t0 = time.monotonic()
        while True:
            yield 1.0 if published <= time.monotonic() - t0 < ends else 0.0

    assert _drain(monkeypatch, readings(), replicas=2) >= ends
    assert _drain(monkeypatch, iter([0.0] * 8)) < 1.5  # one replica: its own count is fresh


def test_a_read_waits_longer_than_the_gateway_waits_for_a_workers_metrics() -> None:
    from pdserve.cluster.metrics import WORKER_SCRAPE_DEADLINE_S

    assert shutdown.SCRAPE_TIMEOUT_S > WORKER_SCRAPE_DEADLINE_S + 1
