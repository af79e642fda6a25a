"""End to end against the fake streaming server (conftest.py): measured TTFT/TPOT match
its delays, failures and timeouts are counted with reasons, the CLI writes JSON and PNGs."""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
import threading
from pathlib import Path

import pytest
from conftest import FakeBehaviour, FakeServer
from machine_speed import SLOWDOWN

from pdserve.cluster.bench.client import Endpoint
from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.driver import Session
from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.bench.workloads import WorkloadKind
from pdserve.cluster.cli import main

D1, D2 = 0.1, 0.02  # first token after D1, then a token every D2
# The client's own delays (reading, parsing, scheduling its tasks) bound how far its figures may lie
# from the server's delays: OVER on a machine of machine_speed.py's speed, more on a slower one.
OVER = 0.001 * SLOWDOWN
# a late first-chunk read (a busy shared CPU) shortens E2E - TTFT a little: TPOT may dip just under D2
TPOT_LO, TPOT_HI = D2 - 2 * OVER, D2 + 6 * OVER
TIMED = FakeBehaviour(first_token_delay=D1, token_interval=D2)


def bench(server: FakeServer, **kw: object) -> Session:
    opts: dict[str, object] = {"num_requests": 12, "input_len": 32, "output_len": 8, "progress": False}
    opts.update(kw)
    session = Session(BenchConfig(server.base_url, **opts), out=io.StringIO())  # type: ignore[arg-type]
    session.run()
    return session


@pytest.mark.parametrize("fake_server", [TIMED], indirect=True)
def test_ttft_and_tpot_match_the_servers_delays(fake_server: FakeServer) -> None:
    s = bench(fake_server, request_rate=50.0)
    recs = s.runs[0].records
    assert all(r.success for r in recs) and len(recs) == 12
    assert D1 <= statistics.median(r.ttft for r in recs) <= D1 + 50 * OVER
    assert TPOT_LO <= statistics.median(r.tpot for r in recs) <= TPOT_HI
    assert D2 - 5 * OVER <= statistics.median(g for r in recs for g in r.itl) <= D2 + 10 * OVER
    assert all(r.output_tokens == 8 and len(r.itl) == 7 for r in recs)
    # what the server was asked: exact token-id prompts, exact output, streamed with usage
    for body in fake_server.bodies:
        assert len(body["prompt"]) == 32 and all(isinstance(t, int) for t in body["prompt"])
        assert body["max_tokens"] == 8 and body["ignore_eos"] is True and body["model"] == "fake-model"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("fake_server", [FakeBehaviour(first_token_delay=D1, token_interval=D2, tokens_per_chunk=4)],
                         indirect=True)
def test_multi_token_chunks_tpot_per_token_itl_per_chunk(fake_server: FakeServer) -> None:
    recs = bench(fake_server, num_requests=4, output_len=9).runs[0].records
    assert all(r.success and r.output_tokens == 9 and r.chunks == 3 for r in recs)
    assert TPOT_LO <= statistics.median(r.tpot for r in recs) <= TPOT_HI
    # Per chunk (4 tokens), not per token; a chunk read late shortens the next gap, as above.
    assert 4 * D2 - 5 * OVER <= statistics.median(g for r in recs for g in r.itl) <= 4 * D2 + 20 * OVER


@pytest.mark.parametrize("fake_server", [FakeBehaviour(fail_every=3)], indirect=True)
def test_failed_requests_are_counted_with_their_reason(fake_server: FakeServer) -> None:
    s = bench(fake_server, slo=SLO(ttft=10.0))
    run = s.runs[0]
    failed = [r for r in run.records if not r.success]
    assert len(run.records) == 12 and len(failed) == 4
    assert {r.error for r in failed} == {"HTTP 500: injected failure"}
    assert "4 x HTTP 500: injected failure" in s.out.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize("fake_server", [FakeBehaviour(hang_every=2)], indirect=True)
def test_every_request_has_a_deadline(fake_server: FakeServer) -> None:
    s = bench(fake_server, num_requests=4, request_timeout=0.5)
    errors = sorted(r.error or "ok" for r in s.runs[0].records)
    assert errors[:2] == ["ok", "ok"] and all(e.startswith("timeout") for e in errors[2:])
    assert s.runs[0].duration < 0.5 + 1500 * OVER


@pytest.mark.parametrize("fake_server", [TIMED], indirect=True)
def test_max_concurrency_queues_on_the_client_and_ttft_excludes_the_queue(fake_server: FakeServer) -> None:
    recs = bench(fake_server, num_requests=6, max_concurrency=2).runs[0].records
    spans = [(r.sent, r.sent + r.e2e) for r in recs]
    for t, _ in spans:
        assert sum(a <= t + 1e-3 < b for a, b in spans) <= 2
    assert max(r.sent for r in recs) > 0.3  # the last pair waited for two before it
    assert max(r.ttft for r in recs) < D1 + 60 * OVER


@pytest.mark.parametrize("fake_server", [FakeBehaviour(first_token_delay=0.01, token_interval=0.005)], indirect=True)
def test_trace_replay_sends_at_the_timestamps(fake_server: FakeServer, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 20, "output_length": 3, "hash_ids": [5]})
                             + "\n" for t in (1000, 1200, 1500)))
    recs = bench(fake_server, workload=WorkloadKind.TRACE, trace=str(trace), block_size=16,
                 num_requests=None).runs[0].records
    assert [r.scheduled for r in recs] == pytest.approx([0.0, 0.2, 0.5])
    assert all(abs(r.sent - r.scheduled) < 30 * OVER for r in recs)
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert all(p[:16] == prompts[0][:16] for p in prompts) and all(len(p) == 20 for p in prompts)


@pytest.mark.parametrize("fake_server", [FakeBehaviour(first_token_delay=D1, token_interval=D2)], indirect=True)
def test_no_ignore_eos_leaves_the_field_out(fake_server: FakeServer) -> None:
    bench(fake_server, num_requests=2, ignore_eos=False)
    assert all("ignore_eos" not in b for b in fake_server.bodies)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.workers.tiny.tokenizer import save_tokenizer, train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(4096, progress=False), out)
    return out


@pytest.mark.parametrize("fake_server", [TIMED], indirect=True)
def test_chat_ttft_skips_the_role_preamble(fake_server: FakeServer, tokenizer_dir: Path) -> None:
    recs = bench(fake_server, num_requests=4, endpoint=Endpoint.CHAT, tokenizer=str(tokenizer_dir)).runs[0].records
    assert all(r.success for r in recs)
    assert min(r.ttft for r in recs) >= D1  # the role chunk came at once: not a token
    assert all(b["max_completion_tokens"] == 8 and isinstance(b["messages"][0]["content"], str)
               for b in fake_server.bodies)


@pytest.mark.parametrize("fake_server", [FakeBehaviour(first_token_delay=0.02, token_interval=0.01, fail_every=5)],
                         indirect=True)
def test_cli_sweep_writes_json_and_plots(fake_server: FakeServer, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res" / "bench.json"
    rc = main(["bench", "--base-url", fake_server.base_url, "--num-requests", "10", "--input-len", "16",
               "--output-len", "4", "--goodput", "ttft:500", "tpot:100", "--sweep", "20,40", "--no-progress",
               "--result-json", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "DistServe goodput" in printed and "Request goodput" in printed
    res = json.loads(out.read_text())
    assert res["config"]["model"] == "fake-model" and res["config"]["slo_ms"] == {"ttft": 500.0, "tpot": 100.0}
    assert [r["request_rate"] for r in res["runs"]] == [20.0, 40.0]
    for run in res["runs"]:
        assert run["summary"]["failed"] == 2 and run["summary"]["completed"] == 8
        assert run["summary"]["goodput"]["attainment"] == pytest.approx(0.8)
        ok = [r for r in run["requests"] if r["success"]]
        assert all(isinstance(r["ttft"], float) and isinstance(r["tpot"], float) and len(r["itl"]) == 3 for r in ok)
    # Each rate sends its own prompts (the same lengths): a repeat would be served
    # from the prefix cache the rate before filled.
    prompts = [tuple(b["prompt"]) for b in fake_server.bodies]
    assert len(prompts) == 20 and len(set(prompts)) == 20 and all(len(p) == 16 for p in prompts)
    # 80% attainment at every rate: below the 90% target from the start
    assert res["sweep"]["distserve_goodput"] == {"rate": None, "method": "below_lowest", "target_attainment": 0.9}
    for name in ("ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "attainment_vs_rate.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


@pytest.mark.parametrize("fake_server", [FakeBehaviour(first_token_delay=0.05, token_interval=0.05)], indirect=True)
def test_ctrl_c_reports_what_was_measured(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cfg = BenchConfig(fake_server.base_url, num_requests=40, input_len=8, output_len=4, request_rate=20.0,
                      progress=False, result_json=str(out))
    timer = threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT))
    # Python's own Ctrl-C handling, whatever this process inherited: a shell that starts
    # a job in the background (`make test &`) starts it with SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer.start()
    try:
        rc = Session(cfg, out=io.StringIO()).run()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, inherited)
    assert rc == 130
    run = json.loads(out.read_text())["runs"][0]
    assert run["interrupted"] is True
    done = [r for r in run["requests"] if r["success"]]
    assert 3 <= len(done) < 40
    assert all(r["error"].startswith("interrupted") for r in run["requests"] if not r["success"])
