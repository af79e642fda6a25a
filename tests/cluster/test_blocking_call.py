"""cluster/blocking_call.py: a call that may never return, bounded; and `pdserve serve`'s start
when Ray Serve's controller stops answering (its calls have no timeout of their own)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.cluster import serve_app
from pdserve.cluster.blocking_call import call_within


def test_a_call_that_returns_or_raises_in_time_is_passed_through() -> None:
    assert call_within(lambda: 42, 5.0, "x") == 42
    with pytest.raises(KeyError, match="gone"):
        call_within(lambda: {}["gone"], 5.0, "x")


def test_a_call_that_never_returns_is_a_timeout_naming_it() -> None:
    stuck = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="^the peer did not answer within 0.2 s$"):
        call_within(stuck.wait, 0.2, "the peer")
    assert 0.2 <= time.monotonic() - start < 5.0
    stuck.set()  # (its daemon thread ends)


def test_a_controller_that_stops_answering_ends_the_deploy_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's `status` waits on its controller with no timeout: a stopped controller held the
    start for ever, past GATEWAY_START_S (checked only between calls). Now each call is bounded,
    the start ends with the CLI's one line, and the app is deleted."""
    hung = threading.Event()
    deleted: list[str] = []
    monkeypatch.setattr(serve_app, "gateway_app", lambda cfg: "app")
    monkeypatch.setattr(serve_app.serve, "RunTarget", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(serve_app.serve, "run_many", lambda targets, **kwargs: [None])
    monkeypatch.setattr(serve_app.serve, "status", lambda: hung.wait())
    monkeypatch.setattr(serve_app.serve, "delete", lambda name, **kwargs: deleted.append(name))
    monkeypatch.setattr(serve_app, "SERVE_CALL_S", 0.3)
    start = time.monotonic()
    try:
        with pytest.raises(ValueError) as caught:
            serve_app.deploy_gateway(Any)  # type: ignore[arg-type]
    finally:
        hung.set()
    assert str(caught.value) == ("the gateway is not up: Ray Serve's controller (the gateway's status) did not "
                                 "answer within 0.3 s")
    assert time.monotonic() - start < 10.0 and deleted == ["pdserve"]
