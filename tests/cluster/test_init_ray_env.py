"""The environment `serve_app.init_ray` leaves in its process: what Ray's processes read at
start. A second call where Ray is up must change nothing (a proxy run's "HAProxy off" once
stayed in the test process, and every `pdserve serve` it started later ran without HAProxy),
and on a local start the `ingress` setting decides the ingress whatever was exported."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cluster import serve_app
from pdserve.cluster.cpu_pinning import node_cores
from pdserve.cluster.ingress import haproxy_threads
from pdserve.cluster.leftovers import haproxy_run_dir
from pdserve.cluster.serve_config import serve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chaos.procs import free_port  # noqa: E402


@pytest.fixture
def environ() -> Iterator[None]:
    """os.environ as it was, after the test (init_ray writes it directly)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _local_start(monkeypatch: pytest.MonkeyPatch, ingress: str, port: int) -> dict[str, str]:
    """The environment init_ray would start local Ray with (ray.init replaced by a recorder);
    the run directory it made for HAProxy removed."""
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(serve_app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve_app.ray, "init", lambda **kwargs: seen.append(dict(os.environ)))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        serve_app.init_ray(serve_config({"model": "tiny", "ingress": ingress, "port": port}))
    finally:
        shutil.rmtree(haproxy_run_dir(port), ignore_errors=True)
    return seen[-1]


def test_a_call_where_ray_is_up_changes_nothing(environ: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_app.ray, "is_initialized", lambda: True)
    before = dict(os.environ)
    serve_app.init_ray(serve_config({"model": "tiny", "ingress": "proxy", "port": free_port()}))
    serve_app.init_ray(serve_config({"model": "tiny", "ingress": "haproxy", "port": free_port()}))
    assert dict(os.environ) == before


def test_the_ingress_setting_wins_over_an_exported_switch_on_a_local_start(
        environ: None, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    env = _local_start(monkeypatch, "haproxy", port)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == str(haproxy_threads(len(node_cores())))
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(haproxy_run_dir(port) + "/")

    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    assert _local_start(monkeypatch, "proxy", free_port())["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def test_an_exported_haproxy_thread_count_is_kept(environ: None, monkeypatch: pytest.MonkeyPatch) -> None:
    os.environ["RAY_SERVE_HAPROXY_NBTHREAD"] = "3"
    assert _local_start(monkeypatch, "haproxy", free_port())["RAY_SERVE_HAPROXY_NBTHREAD"] == "3"
