"""bench/door.py and its fake worker: the fake's engine thread batches every running request's
token into one message per step on the real token stream, and the benchmark, at a tiny size,
streams through the real gateway exactly what the fakes made."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

from pdserve.workers.handoff import ServeRequest
from pdserve.workers.messages import TokenDeltaBatch, decode_as
from pdserve.workers.sampling_params import SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from fake_worker import FAKE_TEXT, FakeEngine, FakeWorker  # noqa: E402 - bench/ is not a package


def test_fake_engine_sends_each_running_request_a_token_a_step() -> None:
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    engine = FakeEngine("fake", step_s=0.01)
    ended: list[BaseException | None] = []
    done = threading.Event()

    def end(error: BaseException | None) -> None:
        ended.append(error)
        if len(ended) == 2:
            done.set()

    try:
        for rid in ("a", "b"):
            engine.submit(ServeRequest(rid, (1, 2), SamplingParams(max_tokens=8), 10.0, address), end)
        assert done.wait(30)
        batches = []
        while pull.poll(1000):
            _tag, body = pull.recv_multipart()
            batches.append(decode_as(body, TokenDeltaBatch))
    finally:
        engine.close()
        pull.close()
    assert ended == [None, None]
    assert [b.seq for b in batches] == list(range(len(batches))) and len(batches) == engine.steps
    assert engine.steps <= 9 and engine.tokens == 16  # the second request may join one step late
    assert max(len(b.deltas) for b in batches) == 2  # a step's tokens of both requests: one message
    for rid in ("a", "b"):
        deltas = [d for b in batches for d in b.deltas if d.request_id == rid]
        assert [d.offset for d in deltas] == list(range(8))
        assert "".join(d.text for d in deltas) == FAKE_TEXT * 8
        assert [d.finish_reason for d in deltas] == [None] * 7 + ["length"]


def test_fake_worker_abort_ends_its_call_and_reports_idle() -> None:
    """What the gateway calls besides serve: abort ends the call (and the tokens); load, drain_state
    and metrics answer as an idle worker's."""
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    worker = FakeWorker("fake", step_ms=5)

    async def run() -> BaseException | None:
        call = asyncio.ensure_future(worker.serve(ServeRequest("r", (1,), SamplingParams(max_tokens=10_000), 30.0,
                                                               address)))
        await asyncio.sleep(0.2)
        assert (await worker.drain_state()).jobs == 1
        await worker.abort("r", 0)
        try:
            await asyncio.wait_for(call, 10)
        except RuntimeError as e:
            return e
        return None

    try:
        assert "aborted" in str(asyncio.run(run()))
        assert asyncio.run(worker.drain_state()).drained
        assert asyncio.run(worker.load()).snapshot.running == 0 and asyncio.run(worker.metrics()) == b""
        assert 0 < worker.engine.tokens < 10_000
    finally:
        worker.close()
        pull.close()


REQUESTS = 100


@pytest.mark.slow
def test_every_stream_gets_what_the_fakes_made(tmp_path: Path) -> None:
    out = tmp_path / "door.json"
    # 100 requests: enough of the gateway's CPU (~0.1 s) that /proc's 10 ms ticks cannot read it as 0
    run = subprocess.run([sys.executable, str(BENCH / "door.py"), "--replicas", "1", "--repeats", "1",
                          "--requests", str(REQUESTS), "--concurrency", "2", "--tokens", "8", "--step-ms", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| 1 | 1 |" in run.stdout  # the table's row
    (r,) = json.loads(out.read_text())["runs"]
    assert r["gateway_processes"] == 1 and r["failed"] == 0
    assert all(rec["success"] and rec["output_tokens"] == 8 and 1 <= rec["chunks"] <= 8 for rec in r["records"])
    assert r["tokens"] == REQUESTS * 8 and len(r["records"]) == REQUESTS
    assert r["sample_text"] == FAKE_TEXT * 8
    # the warm-up (2 x concurrency), the timed requests and the sample: every token sent, and no more
    assert r["tokens_sent_by_fakes"] == r["tokens_received"] == (2 * 2 + REQUESTS + 1) * 8
    assert all(v >= 0 for v in r["cpu_s"].values()) and r["cpu_s"]["gateway"] > 0
