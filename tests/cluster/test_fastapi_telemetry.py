"""FastAPI's own OpenTelemetry is off in the gateway unless the environment configures
OpenTelemetry (cluster/openai_app.py `telemetry_options`): its per-request checks cost
CPU and record nothing where no provider is set up."""

from __future__ import annotations

import inspect

import pytest
from fastapi import FastAPI

from pdserve.cluster.openai_app import TELEMETRY_OFF, telemetry_options

pytestmark = pytest.mark.skipif("telemetry" not in inspect.signature(FastAPI.__init__).parameters,
                                reason="this FastAPI has no native telemetry")


def test_off_where_nothing_configures_opentelemetry() -> None:
    assert telemetry_options({"PATH": "/usr/bin", "RAY_ADDRESS": "auto"}) == {"telemetry": TELEMETRY_OFF}


@pytest.mark.parametrize("env", [{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"},
                                 {"OTEL_SERVICE_NAME": "gateway"}, {"FASTAPI_OTEL_AUTO_CONFIGURE": "true"}])
def test_fastapis_default_where_the_environment_configures_it(env: dict[str, str]) -> None:
    assert telemetry_options(env) == {}


def test_off_records_no_span_where_fastapis_default_records_them() -> None:
    """TELEMETRY_OFF names FastAPI's own switches: with a tracer of its own an app records
    spans by default and none with them off."""
    from fastapi.testclient import TestClient

    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = {}
    for name, options in (("default", {}), ("off", telemetry_options({})["telemetry"])):
        exporter = InMemorySpanExporter()
        provider = sdk.TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        app = FastAPI(telemetry={**options, "tracer_provider": provider})
        app.get("/x")(lambda: {"ok": 1})
        with TestClient(app) as client:
            assert client.get("/x").status_code == 200
        spans[name] = len(exporter.get_finished_spans())
    assert spans["default"] > 0 and spans["off"] == 0, spans
