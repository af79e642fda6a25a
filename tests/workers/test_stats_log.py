"""A served worker's stats line (vLLM's "Avg prompt throughput ..." line): what it says, when it
speaks, that it stays quiet while idle, and that `disable_log_stats` turns it off."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.stats_log import LOGGER, StatsLog
from pdserve.workers.tiny.builder import TinyModelSpec


def test_the_line_says_each_figure_over_the_interval() -> None:
    lines: list[str] = []
    log = StatsLog("w0", interval_s=10, clock=lambda: 0.0, emit=lines.append)
    log.observe(EngineSnapshot(running=3, waiting=2, free_blocks=75, total_blocks=100, prompt_tokens=400,
                               prompt_tokens_cached=100, prompt_tokens_computed=300, generation_tokens=50), 10.0)
    log.observe(EngineSnapshot(running=1, free_blocks=90, total_blocks=100, prompt_tokens=600,
                               prompt_tokens_cached=250, prompt_tokens_computed=350, generation_tokens=250,
                               spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=30, preemptions=2), 20.0)
    assert lines == [
        "w0: prompt throughput 30.0 tokens/s, generation throughput 5.0 tokens/s, running 3 reqs, waiting 2 reqs, "
        "KV cache usage 25.0%, prefix cache hit rate 25.0%",
        # 50 prompt tokens and 200 generated in 10 s; 150 of 200 looked up were cached; 30 of 40 drafts
        # accepted over 10 verify steps: 4 tokens a step with the bonus token
        "w0: prompt throughput 5.0 tokens/s, generation throughput 20.0 tokens/s, running 1 reqs, waiting 0 reqs, "
        "KV cache usage 10.0%, prefix cache hit rate 75.0%, draft acceptance rate 75.0%, mean acceptance length "
        "4.00, preemptions 2"]


def test_an_idle_engine_logs_one_line_of_zeros_then_nothing() -> None:
    lines: list[str] = []
    log = StatsLog("w0", interval_s=10, clock=lambda: 0.0, emit=lines.append)
    log.observe(EngineSnapshot(total_blocks=10, free_blocks=10), 10.0)  # never worked: nothing
    assert lines == []
    log.observe(EngineSnapshot(total_blocks=10, free_blocks=10, generation_tokens=100), 20.0)
    log.observe(EngineSnapshot(total_blocks=10, free_blocks=10, generation_tokens=100), 30.0)  # fell idle
    log.observe(EngineSnapshot(total_blocks=10, free_blocks=10, generation_tokens=100), 40.0)
    assert len(lines) == 2 and "generation throughput 10.0" in lines[0]
    assert "generation throughput 0.0" in lines[1] and "prefix cache hit rate n/a" in lines[1]


def test_tick_waits_for_the_interval() -> None:
    now = [0.0]
    lines: list[str] = []
    log = StatsLog("w0", interval_s=10, clock=lambda: now[0], emit=lines.append)

    class Busy:
        def snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(running=1, total_blocks=1, free_blocks=1)

    for t in (1.0, 9.9, 10.0, 15.0, 19.9, 20.5):
        now[0] = t
        log.tick(Busy())  # type: ignore[arg-type]
    assert len(lines) == 2


def test_a_failing_snapshot_turns_the_line_off_and_spares_the_engine_thread() -> None:
    lines: list[str] = []
    log = StatsLog("w0", interval_s=1, clock=lambda: 5.0, emit=lines.append)

    class Broken:
        def snapshot(self) -> EngineSnapshot:
            raise RuntimeError("boom")

    log.tick(Broken())  # type: ignore[arg-type]
    log.tick(Broken())  # type: ignore[arg-type]
    assert lines == []


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2))


def test_a_served_engine_logs_what_it_generated(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Through the engine thread and the `pdserve.stats` logger: the generated tokens the lines count
    add up to what the request generated, and `disable_log_stats` leaves no logger at all."""
    quiet = AsyncEngine(LLM(str(model_dir), max_model_len=128, num_kv_blocks=32, progress=False,
                            disable_log_stats=True).engine)
    assert quiet._stats_log is None
    quiet.engine.close()

    ae = AsyncEngine(LLM(str(model_dir), max_model_len=128, num_kv_blocks=32, progress=False).engine,
                     worker_id="worker-7")
    assert ae._stats_log is not None
    ae._stats_log = StatsLog("worker-7", interval_s=0.2)  # the real logger, a short interval
    ae.start()
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            async def run() -> int:
                params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
                return sum([len(o.outputs[0].token_ids) async for o in ae.generate("r", [5, 6, 7, 8], params)])

            generated = asyncio.run(run())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any("generation throughput 0.0" in r.getMessage()
                                                          for r in caplog.records):
                time.sleep(0.05)
    finally:
        ae.close()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines and all(line.startswith("worker-7: prompt throughput") for line in lines)
    assert "generation throughput 0.0" in lines[-1] and "running 0 reqs" in lines[-1]
    assert generated == 40
    assert re.search(r"KV cache usage \d+\.\d%", lines[0])
