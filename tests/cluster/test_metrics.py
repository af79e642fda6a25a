"""The gateway's `GET /metrics`: latencies of a backend with known delays land in
the right buckets, errors are counted by code, workers' expositions merge into
one valid exposition within the scrape deadline, and on local Ray every family
of the metric contract is there for every worker."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import FakeBackend, LocalActor, local_cluster, sse_error_code, tiny_spec
from metrics_store import parse, sample
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.router import NoHealthyWorkerError, Router, RouterConfig, WorkerLoad, WorkerRole
from pdserve.cluster.worker_metrics import Pool, WorkerMetrics
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.config import EngineConfig
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

MODEL = "tiny"

GATEWAY_FAMILIES = [
    "pdserve:time_to_first_token_seconds", "pdserve:time_per_output_token_seconds",
    "pdserve:inter_token_latency_seconds", "pdserve:e2e_request_latency_seconds", "pdserve:request_queue_time_seconds",
    "pdserve:prompt_tokens", "pdserve:generation_tokens", "pdserve:request_success", "pdserve:request_errors",
    "pdserve:num_requests_in_flight", "pdserve:num_requests_queued", "pdserve:gateway_requests", "pdserve:worker_up",
    "pdserve:router_decisions", "pdserve:router_prompt_tokens", "pdserve:router_cached_prompt_tokens",
]
WORKER_FAMILIES = [
    "pdserve:kv_cache_usage_perc", "pdserve:num_requests_running", "pdserve:num_requests_waiting",
    "pdserve:prefix_cache_queries", "pdserve:prefix_cache_hits", "pdserve:num_preemptions",
    "pdserve:iteration_prefill_tokens", "pdserve:iteration_decode_batch_size", "pdserve:engine_step_duration_seconds",
    "pdserve:spec_decode_num_drafts", "pdserve:spec_decode_num_draft_tokens", "pdserve:spec_decode_num_accepted_tokens",
    "pdserve:spec_decode_num_accepted_tokens_per_pos", "pdserve:kv_transfer_bytes",
    "pdserve:kv_transfer_duration_seconds", "pdserve:kv_transfer_failures", "pdserve:cpu_turn_wait_seconds",
    "pdserve:cpu_turns_missed", "pdserve:cpu_wide_steps",
]


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


CONTRACT = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "metrics.yaml"


def assert_matches_contract(fams: dict[str, Any]) -> None:
    """Every series of deploy/prometheus/metrics.yaml (the names the rules and the
    dashboard use) is exported with its type, labels and buckets, and nothing else is."""
    import yaml

    contract = {m["name"]: m for m in yaml.safe_load(CONTRACT.read_text())["metrics"]}
    exported = {}
    for fam in fams.values():
        exposition_name = f"{fam.name}_total" if fam.type == "counter" else fam.name
        exported[exposition_name] = fam
    assert set(exported) == set(contract)
    for name, spec in contract.items():
        fam = exported[name]
        assert fam.type == spec["type"], name
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == set(spec["labels"]), (name, s.labels)
        if spec["type"] == "histogram":
            les = {float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")}
            assert les == {*map(float, spec["buckets"]), float("inf")}, name


def bucket_counts(fams: dict[str, Any], family: str) -> dict[str, float]:
    return {s.labels["le"]: s.value for s in fams[family].samples if s.name == f"{family}_bucket"}


def only_in(fams: dict[str, Any], family: str, lo: str, hi: str) -> bool:
    """Every observation of `family` is in the bucket (lo, hi]."""
    b = bucket_counts(fams, family)
    return b[lo] == 0 and b[hi] == b["+Inf"] > 0


class Clock:
    """The metrics' clock in this test: moved by the backend by exactly its delays, so the
    latencies are what the plan says on a machine however loaded (real sleeps still order
    the test's scrapes against the tokens)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


class TimedBackend(FakeBackend):
    """Tokens at known times: the first after 0.35 s, then 1 token after 0.25 s,
    2 tokens after 0.5 s, 1 token after 0.25 s. Queue time 0.12 s on the first
    output (later outputs say otherwise: only the first counts)."""
    plan = [(0.35, 1), (0.25, 1), (0.5, 2), (0.25, 1)]

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        for i, (delay, n) in enumerate(self.plan):
            await asyncio.sleep(delay)
            if self.clock is not None:
                self.clock.now += delay
            last = i == len(self.plan) - 1
            yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x" * n, [7] * n,
                                                                            finish_reason="length" if last else None)],
                                finished=last, metrics={"queue_time_s": 0.12 if i == 0 else 0.9})


def test_latencies_of_known_delays_land_in_their_buckets(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cluster import metrics

    clock = Clock()
    monkeypatch.setattr(metrics, "time", clock)  # a loaded CI machine's scheduling delays: not in the figures
    gw = Gateway(TimedBackend(clock), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5, "stream": True}
            req = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.15)
            before_first = parse((await c.get("/metrics")).text)
            await asyncio.sleep(0.5)
            after_first = parse((await c.get("/metrics")).text)
            r = await req
            assert r.status_code == 200 and "[DONE]" in r.text
            return before_first, after_first, parse((await c.get("/metrics")).text)

    before_first, after_first, f = asyncio.run(main())
    assert sample(before_first, "pdserve:num_requests_in_flight") == 1
    assert sample(before_first, "pdserve:num_requests_queued") == 1
    assert sample(after_first, "pdserve:num_requests_queued") == 0
    assert sample(after_first, "pdserve:num_requests_in_flight") == 1
    assert sample(f, "pdserve:num_requests_in_flight") == sample(f, "pdserve:num_requests_queued") == 0

    assert sample(f, "pdserve:time_to_first_token_seconds_count") == 1
    assert only_in(f, "pdserve:time_to_first_token_seconds", "0.3", "0.4")
    assert sample(f, "pdserve:inter_token_latency_seconds_count") == 4  # 1 + 2 (the 2-token chunk) + 1
    assert only_in(f, "pdserve:inter_token_latency_seconds", "0.2", "0.3")
    assert sample(f, "pdserve:time_per_output_token_seconds_count") == 1  # (1.0 s) / (5 - 1)
    assert only_in(f, "pdserve:time_per_output_token_seconds", "0.2", "0.3")
    assert only_in(f, "pdserve:e2e_request_latency_seconds", "1.0", "2.5")
    assert sample(f, "pdserve:request_queue_time_seconds_count") == 1
    assert only_in(f, "pdserve:request_queue_time_seconds", "0.1", "0.15")
    assert sample(f, "pdserve:prompt_tokens_total") == 3 and sample(f, "pdserve:generation_tokens_total") == 5
    assert sample(f, "pdserve:request_success_total", finished_reason="length") == 1
    assert sample(f, "pdserve:request_success_total", finished_reason="stop") == 0
    assert sample(f, "pdserve:gateway_requests_total", endpoint="/v1/completions", status="200") == 1
    assert sample(f, "pdserve:gateway_requests_total", endpoint="/metrics", status="200") == 2


class FailingBackend(FakeBackend):
    """Sends one token, then fails the way `error` says."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout_s: float) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7])], finished=False)
        raise self.error


class Unhealthy(FakeBackend):
    """No worker can take a request now."""

    healthy = False


def test_errors_are_counted_by_code_including_in_band_stream_errors(tokenizer: Any) -> None:
    cfg = GatewayConfig(model_name=MODEL, max_model_len=256, api_key="sekret")
    gw = Gateway(FailingBackend(TimeoutError("deadline")), tokenizer, cfg)
    app = build_app(gw)
    auth = {"Authorization": "Bearer sekret"}

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
            assert (await c.post("/v1/completions", json=ok)).status_code == 401
            assert (await c.post("/v1/completions", json=ok, headers={"Authorization": "Bearer no"})).status_code == 401
            assert (await c.post("/v1/completions", json={**ok, "max_tokens": 0}, headers=auth)).status_code == 400
            assert (await c.post("/v1/completions", json={**ok, "top_p": 7}, headers=auth)).status_code == 400
            assert (await c.post("/v1/completions", json={**ok, "model": "gpt-4"}, headers=auth)).status_code == 404
            assert (await c.post("/v1/completions", json=ok, headers=auth)).status_code == 504  # not streamed
            r = await c.post("/v1/completions", json={**ok, "stream": True}, headers=auth)
            assert r.status_code == 200 and sse_error_code(r.text) == 504  # reported in-band
            gw.backend = FailingBackend(RuntimeError("worker died"))
            r = await c.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user", "content": "a"}], "stream": True},
                             headers=auth)
            assert sse_error_code(r.text) == 500
            gw.backend = FailingBackend(NoHealthyWorkerError("decode"))
            r = await c.post("/v1/completions", json=ok, headers=auth)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            gw.backend = Unhealthy()  # turned away at admission: clients retry after the hint
            r = await c.post("/v1/completions", json={**ok, "stream": True}, headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            return parse((await c.get("/metrics", headers=auth)).text)  # the API key opens /metrics

    f = asyncio.run(main())
    errors = {s.labels["code"]: s.value for s in f["pdserve:request_errors"].samples}
    assert errors == {"400": 2, "401": 2, "404": 1, "429": 0, "499": 0, "500": 1, "503": 2, "504": 2}
    assert sum(s.value for s in f["pdserve:request_success"].samples) == 0
    # The requests that failed after their first token still had one.
    assert sample(f, "pdserve:time_to_first_token_seconds_count") == 4
    assert sample(f, "pdserve:num_requests_in_flight") == sample(f, "pdserve:num_requests_queued") == 0


class FakeWorker:
    def __init__(self, metrics: WorkerMetrics | None) -> None:
        self.m = metrics

    async def metrics(self) -> bytes:
        if self.m is None:
            await asyncio.sleep(30)  # hangs past any deadline
        return self.m.render()


class WorkersBackend(TimedBackend):
    plan = [(0.0, 1), (0.0, 1)]

    def __init__(self, workers: dict[str, tuple[str, Any]], router: Router) -> None:
        self.workers, self.router = workers, router

    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        return self.workers

    def router_stats(self) -> Any:
        return self.router.stats


def test_scrape_merges_workers_and_reports_a_hung_one_down_in_time(tokenizer: Any) -> None:
    p0, d0 = WorkerMetrics(Pool.PREFILL, "pdserve-prefill-0", 4), WorkerMetrics(Pool.DECODE, "pdserve-decode-0", 4)
    p0.on_failure("checksum")
    d0.on_handoff(1000, 0.02)  # (a receiver never does; here it tells the workers' samples apart)
    router = Router(RouterConfig(), block_size=16)
    router.update_load(WorkerLoad("p0", WorkerRole.PREFILL, total_blocks=64, free_blocks=64))
    router.update_load(WorkerLoad("d0", WorkerRole.DECODE, total_blocks=64, free_blocks=64))
    decision = router.route("r", list(range(5, 200)))
    workers = {"pdserve-prefill-0": ("prefill", LocalActor(FakeWorker(p0))),
               "pdserve-decode-0": ("decode", LocalActor(FakeWorker(d0))),
               "pdserve-decode-1": ("decode", LocalActor(FakeWorker(None))),
               "pdserve-decode-2": ("decode", None)}  # not found by its name (not up yet): down too
    gw = Gateway(WorkersBackend(workers, router), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> tuple[str, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            t0 = time.monotonic()
            r = await c.get("/metrics")
            return r.text, time.monotonic() - t0

    text, took = asyncio.run(main())
    assert took < 2.0 + 1.0  # the 2 s fetch deadline, plus parsing, on a loaded machine
    f = parse(text)
    up = {s.labels["worker"]: s.value for s in f["pdserve:worker_up"].samples}
    assert up == {"pdserve-prefill-0": 1, "pdserve-decode-0": 1, "pdserve-decode-1": 0, "pdserve-decode-2": 0}
    # One family, samples of both workers.
    assert sample(f, "pdserve:kv_transfer_failures_total", worker="pdserve-prefill-0", kind="checksum") == 1
    assert sample(f, "pdserve:kv_transfer_failures_total", worker="pdserve-decode-0", kind="checksum") == 0
    assert sample(f, "pdserve:kv_transfer_bytes_total", worker="pdserve-decode-0") == 1000
    assert {s.labels["worker"] for s in f["pdserve:kv_cache_usage_perc"].samples} == {"pdserve-prefill-0",
                                                                                     "pdserve-decode-0"}
    assert sample(f, "pdserve:router_decisions_total", role="prefill", reason=decision.reason.value) == 1
    assert sample(f, "pdserve:router_decisions_total", role="decode", reason=decision.decode_reason.value) == 1
    assert sum(s.value for s in f["pdserve:router_decisions"].samples) == 2
    assert sample(f, "pdserve:router_cached_prompt_tokens_total") == decision.cached_prompt_tokens
    assert sample(f, "pdserve:router_prompt_tokens_total") == decision.prompt_tokens
    assert not any(name.endswith("_created") for name in f)
    assert_matches_contract(f)


def test_token_counters_equal_engine_truth(model_dir: Path, tokenizer: Any) -> None:
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False)
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for stream in (True, False):
                body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "stream": stream, "ignore_eos": True}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
            return parse((await c.get("/metrics")).text)

    try:
        f = asyncio.run(main())
    finally:
        engine.close()
    assert sample(f, "pdserve:generation_tokens_total") == llm.engine.stats.generation_tokens == 12
    assert sample(f, "pdserve:prompt_tokens_total") == llm.engine.stats.prompt_tokens == 8
    assert sample(f, "pdserve:request_success_total", finished_reason="length") == 2
    assert sample(f, "pdserve:request_queue_time_seconds_count") == 2  # the engine's queue time, once per request
    assert sample(f, "pdserve:time_per_output_token_seconds_count") == 2
    # One in-process engine: a pool of one, no stream, nothing to migrate.
    assert sample(f, "pdserve:pool_workers_live", pool="engine") == 1
    assert sample(f, "pdserve:pool_workers_configured", pool="engine") == 1
    assert {s.labels["state"]: s.value for s in f["pdserve:health_state"].samples} == \
        {"ok": 1, "degraded": 0, "unavailable": 0}
    assert sample(f, "pdserve:request_migrations_total") == 0


def test_services_export_their_engines_metrics_through_the_disaggregated_backend(model_dir: Path,
                                                                                 tokenizer: Any) -> None:
    """The real worker services in this process (LocalActor for Ray): the
    backend names its workers, their `metrics()` feed the gateway's scrape, and
    the queue time of the prefill worker reaches the gateway once per request."""
    from pdserve.cluster.actors import DecodeService, PrefillService
    from pdserve.cluster.disagg_backend import DisaggregatedBackend

    base = EngineConfig(model=str(model_dir), max_model_len=256, num_kv_blocks=64)
    p = PrefillService(base, 1, worker_name="pdserve-prefill-0")
    d = DecodeService(base, 1, "127.0.0.1", worker_name="pdserve-decode-0")
    backend = DisaggregatedBackend({"p0": LocalActor(p)}, {"d0": LocalActor(d)},
                                   Router(RouterConfig(), 16), poll_s=0.01,
                                   names={"p0": "pdserve-prefill-0", "d0": "pdserve-decode-0"})
    gw = Gateway(backend, tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    app = build_app(gw)
    prompt = list(range(5, 85))  # 5 blocks: prefilled on p0, sent to d0

    async def main() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            for max_tokens in (6, 2):  # both handed off (max_tokens 1 would stay on the prefill worker)
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
                assert "[DONE]" in (await c.post("/v1/completions", json=body)).text
            f = parse((await c.get("/metrics")).text)
        await backend.close()
        return f

    try:
        f = asyncio.run(main())
    finally:
        p.close()
        d.close()
    assert {s.labels["worker"]: s.value for s in f["pdserve:worker_up"].samples} == \
        {"pdserve-prefill-0": 1, "pdserve-decode-0": 1}
    k, _ = p.worker.engine.kv_caches[0]
    layers = p.worker.engine.model_config.num_layers
    # 5 blocks, then again minus those the decode worker kept in its own prefix cache (not sent).
    decode_hits = sample(f, "pdserve:prefix_cache_hits_total", worker="pdserve-decode-0")
    assert decode_hits == 64 == d.worker.engine.snapshot().prompt_tokens_cached
    assert sample(f, "pdserve:kv_transfer_bytes_total", worker="pdserve-prefill-0") == \
        (5 + 5 - 64 // 16) * layers * 2 * k[0].numel() * k.element_size()
    assert sample(f, "pdserve:kv_transfer_duration_seconds_count", worker="pdserve-prefill-0") == 2
    assert sample(f, "pdserve:prefix_cache_queries_total", worker="pdserve-prefill-0") == 2 * 80
    assert sample(f, "pdserve:prefix_cache_hits_total", worker="pdserve-prefill-0") == 64  # the rerun's full blocks
    assert sample(f, "pdserve:engine_step_duration_seconds_count", worker="pdserve-decode-0") == \
        d.worker.engine.stats.steps
    assert sample(f, "pdserve:request_queue_time_seconds_count") == 2
    assert sample(f, "pdserve:generation_tokens_total") == 8
    assert sum(s.value for s in f["pdserve:router_decisions"].samples if s.labels["role"] == "decode") == 2
    assert_matches_contract(f)


# -- end to end on local Ray ------------------------------------------------------


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[str, Any]]:
    pytest.importorskip("ray")
    from pdserve.cluster.serve_config import serve_config

    port = 20000 + os.getpid() % 1000
    # Serve's Python proxy: the HAProxy ingress binds fixed ports, which another
    # cluster on this machine may hold (the metrics path is the same either way).
    cfg = serve_config({"model": str(model_dir), "port": port, "max_model_len": 256, "ingress": "proxy",
                        "num_kv_blocks": 128, "speculative": "ngram"})
    with local_cluster(cfg) as url:
        yield url, cfg


def test_one_scrape_has_every_contract_family_for_every_worker(served: tuple[str, Any]) -> None:
    url, cfg = served
    body = {"model": os.path.basename(cfg.model), "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(3):  # long enough for the prefill worker (not a local prefill on the decode worker)
            r = c.post("/v1/completions", json={**body, "prompt": list(range(10 + i, 90 + i))})
            assert r.status_code == 200 and "[DONE]" in r.text
        f = parse(c.get("/metrics").text)

    workers = {("prefill", n) for n in cfg.prefill_names()} | {("decode", n) for n in cfg.decode_names()}
    for name in GATEWAY_FAMILIES + WORKER_FAMILIES:
        assert name in f and f[name].samples, name
    for name in WORKER_FAMILIES:
        assert {(s.labels["pool"], s.labels["worker"]) for s in f[name].samples} == workers, name
    assert {(s.labels["pool"], s.labels["worker"]): s.value for s in f["pdserve:worker_up"].samples} == \
        dict.fromkeys(workers, 1)
    assert sample(f, "pdserve:time_to_first_token_seconds_count") == 3
    assert sample(f, "pdserve:generation_tokens_total") == 24
    assert sample(f, "pdserve:request_queue_time_seconds_count") == 3
    assert sample(f, "pdserve:kv_transfer_bytes_total", worker="pdserve-prefill-0") > 0
    assert sample(f, "pdserve:kv_transfer_duration_seconds_count", worker="pdserve-prefill-0") == 3
    assert sum(s.value for s in f["pdserve:router_decisions"].samples if s.labels["role"] == "prefill") == 3
    assert_matches_contract(f)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_of_n_choices_is_timed_on_its_own(make_model: Callable[[TinyModelSpec], Path], stream: bool) -> None:
    """n = 4 choices, each 5 tokens 50 ms apart, interleaved: TPOT and ITL are each choice's
    (~50 ms, as vLLM times each sample), not ~12 ms (the four choices' tokens in one line);
    generation tokens and end-to-end latency are one sample per choice."""
    from factories import serve_gateway
    from transformers import AutoTokenizer

    from pdserve.workers.outputs import CompletionOutput, RequestOutput

    gap = 0.05

    class Paced(FakeBackend):
        async def generate(self, request_id: str, prompt: list[int], params: Any,
                           timeout_s: float) -> AsyncIterator[RequestOutput]:
            for k in range(5):
                await asyncio.sleep(gap)
                yield RequestOutput(request_id, None, prompt, [CompletionOutput(0, "x", [7], None, None,
                                                                                "length" if k == 4 else None)], k == 4)

    tok = AutoTokenizer.from_pretrained(make_model(tiny_spec()))
    gw = Gateway(Paced(), tok, GatewayConfig(model_name="tiny", max_model_len=256))
    with serve_gateway(gw) as url:
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "n": 4, "stream": stream})
        assert r.status_code == 200
        text = httpx.get(url + "/metrics").text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    tpot = got["pdserve:time_per_output_token_seconds_sum"] / got["pdserve:time_per_output_token_seconds_count"]
    itl = got["pdserve:inter_token_latency_seconds_sum"] / got["pdserve:inter_token_latency_seconds_count"]
    assert got["pdserve:time_per_output_token_seconds_count"] == 4 and tpot >= 0.8 * gap
    assert got["pdserve:inter_token_latency_seconds_count"] == 16 and itl >= 0.8 * gap
    assert got["pdserve:request_generation_tokens_count"] == 4 and got["pdserve:request_generation_tokens_sum"] == 20
    assert got["pdserve:e2e_request_latency_seconds_count"] == 4
    assert got["pdserve:time_to_first_token_seconds_count"] == 4
