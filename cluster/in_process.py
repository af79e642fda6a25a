"""The cluster in one process, without Ray: worker services behind handles that behave as
Ray's do, and a gateway served by uvicorn on a thread. Tests use it, and so does a lent
GPU's served check (bench/gpu_served.py), where Ray cannot be installed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


class LocalActor:
    """Stands in for a Ray actor handle over a plain service object in this process:
    `handle.method.remote(...)` behaves as with Ray (a task that runs even if nobody
    awaits it). The cluster's coordinator (the backend) runs over these unchanged."""

    def __init__(self, service: object) -> None:
        self._service = service

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._service, name))


class _LocalMethod:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: object) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.ensure_future(self._fn(*args))
        return fut


@contextlib.contextmanager
def serve_gateway(gw: Any, log_level: str = "critical", start_timeout_s: float = 20.0) -> Iterator[str]:
    """Serve a Gateway's app with uvicorn on a free loopback port (a thread), yield its base
    URL, and stop it whatever happens."""
    import uvicorn

    from pdserve.cluster.openai_app import build_app

    # Bound here and handed to uvicorn: a port probed free and bound later can be taken in between.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(gw), host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True, name="pd-uvicorn")
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    if not srv.started:
        srv.should_exit = True
        thread.join(10)
        sock.close()
        raise TimeoutError(f"uvicorn did not start within {start_timeout_s} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()
