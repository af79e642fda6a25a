"""A request cannot kill a worker (issue 46): whatever one request's values or logits do
on the engine thread, the engine fails that request alone and the batch goes on.

The bad values are slipped past SamplingParams' checks on purpose (frozen fields set
after validation): what a bug in validation, or a NaN the model makes, would hand the
engine. The oracle for the other requests is the same engine's output without the bad
one: token for token the same."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.async_engine import AsyncEngine, RequestFaultError
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.row_faults import MAX_FAULT_STREAK, MAX_JUDGED_ROWS, NoRoomToCheck, isolate
from pdserve.workers.sampler import NO_TOKEN, SamplingBatch, checked, sample
from pdserve.workers.tiny.builder import TinyModelSpec

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec())


def _llm(model_dir: Path, **kw: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64, progress=False, **kw)


def _slip(engine: LLMEngine, rid: str, values: dict[str, object]) -> None:
    """Set `values` on a request's parameters once the engine has checked and taken it:
    what a checking bug would let through."""
    params = engine.scheduler.requests[rid].params
    for name, value in values.items():
        object.__setattr__(params, name, value)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
         slip: dict[str, dict[str, object]] | None = None) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for rid, values in (slip or {}).items():
        _slip(engine, rid, values)
    finals: dict[str, RequestOutput] = {}
    for _ in range(200):  # bounded: 12 tokens a request
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _clean(model_dir: Path) -> dict[str, list[int]]:
    finals = _run(_llm(model_dir).engine, {f"ok{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


def test_checked_marks_rows_without_a_valid_token() -> None:
    logits = torch.randn(4, 10)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    tokens = torch.tensor([3, 4, 0, 10])  # row 3: outside the vocabulary (a NaN draw's index)
    out, safe = checked(tokens, logits)
    assert out.tolist() == [3, NO_TOKEN, NO_TOKEN, NO_TOKEN]
    assert safe.tolist() == [3, 4, 0, 9]


def test_a_denormal_temperature_row_gets_no_token_and_the_others_sample() -> None:
    """1e-40 divides logits to +-inf: softmax is NaN. That row alone gets NO_TOKEN."""
    logits = torch.randn(3, 50) * 5
    temperature = torch.tensor([0.0, 1e-40, 0.7])
    out = sample(logits.clone(), SamplingBatch(temperature=temperature, all_greedy=False, max_logprobs=2))
    tokens = out.token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == NO_TOKEN
    assert 0 <= tokens[2] < 50
    assert out.sampled_logprob is not None and torch.isfinite(out.sampled_logprob[[0, 2]]).all()


@pytest.mark.parametrize("bad", [
    {"top_k": 2**63},  # overflows the int64 tensor of the batch's top-k: the whole step raises
    {"temperature": 1e-40},  # NaN distribution: a NO_TOKEN row
], ids=["top_k_overflow", "denormal_temperature"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_bad_row_fails_alone_and_the_batch_keeps_its_tokens(model_dir: Path, bad: dict[str, object],
                                                              async_scheduling: bool) -> None:
    """Async scheduling too: the bad row's next step is already launched, fed a placeholder
    for its missing token, when its NO_TOKEN lands; that row is dropped."""
    want = _clean(model_dir)
    engine = _llm(model_dir, async_scheduling=async_scheduling).engine
    requests = {f"ok{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    requests["bad"] = ([20, 21, 22], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    finals = _run(engine, requests, {"bad": bad})
    assert {rid: finals[rid].outputs[0].token_ids for rid in want} == want
    assert all(finals[rid].error is None for rid in want)
    failed = finals["bad"]
    assert failed.finished and failed.outputs[0].finish_reason == "abort" and failed.error
    assert engine.stats.request_faults == 1
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()
    # The engine goes on serving: a new request gets the clean output.
    again = _run(engine, {"after": (PROMPTS[0], GREEDY)})
    assert again["after"].outputs[0].token_ids == want["ok0"]


def test_isolate_reraises_what_no_row_explains() -> None:
    boom = RuntimeError("batch")

    def every_row_fails(rows: list[int]) -> None:
        raise RuntimeError(f"row {rows}")

    def engine_broken() -> None:
        raise RuntimeError("engine")

    with pytest.raises(RuntimeError, match="batch") as raised:
        isolate(every_row_fails, [1, 2], boom, engine_broken)
    assert str(raised.value.__cause__) == "engine"
    with pytest.raises(RuntimeError, match="batch"):
        isolate(every_row_fails, [1], boom, engine_broken)
    with pytest.raises(RuntimeError, match="batch"):
        isolate(lambda rows: None, [1, 2], boom, engine_broken)  # only the batch fails: not a row's fault
    # Every row fails alone and the engine runs a step of its own: the rows are the faults.
    assert [r for r, _ in isolate(every_row_fails, [1, 2], boom, lambda: None)] == [1, 2]
    assert isolate(every_row_fails, [7], boom, lambda: None) == [(7, boom)]
    # More than MAX_JUDGED_ROWS all failing alone: the engine's, whatever its own step does.
    with pytest.raises(RuntimeError, match="batch"):
        isolate(every_row_fails, list(range(MAX_JUDGED_ROWS + 1)), boom, lambda: None)

    def no_room() -> None:
        raise NoRoomToCheck("full")

    # No room for its own step: one row alone is its fault, two are the engine's.
    assert isolate(every_row_fails, [7], boom, no_room) == [(7, boom)]
    with pytest.raises(RuntimeError, match="batch"):
        isolate(every_row_fails, [1, 2], boom, no_room)

    def odd_rows_fail(rows: list[int]) -> None:
        if rows[0] % 2:
            raise ValueError(f"row {rows[0]}")

    assert [(r, str(e)) for r, e in isolate(odd_rows_fail, [1, 2, 3, 4], boom, engine_broken)] == [(1, "row 1"),
                                                                                                  (3, "row 3")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_bad_requests_alone_in_a_step_fail_and_the_engine_goes_on(model_dir: Path,
                                                                      async_scheduling: bool) -> None:
    """A pair of bad rows with nothing else in their steps: each fails alone, so the engine
    checks itself with a step of its own, runs it, and fails the pair, not itself (a worker
    once stopped here, and the pair, migrated, could stop the next one too)."""
    want = _clean(model_dir)
    engine = _llm(model_dir, async_scheduling=async_scheduling).engine
    bad = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    finals = _run(engine, {"bad1": ([20, 21, 22], bad), "bad2": ([23, 24], bad)},
                  {"bad1": {"top_k": 2**63}, "bad2": {"top_k": 2**63}})
    assert set(finals) == {"bad1", "bad2"}
    assert all(out.error and out.outputs[0].finish_reason == "abort" for out in finals.values())
    assert engine.stats.request_faults == 2
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()
    again = _run(engine, {"after": (PROMPTS[0], GREEDY)})
    assert again["after"].outputs[0].token_ids == want["ok0"]


def test_a_bad_request_in_a_full_cache_fails_alone(model_dir: Path) -> None:
    """Every block held by the one running request: the engine has no room for a step of its
    own, and a row failing alone in a step of its own is its fault, as before the check."""
    engine = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=4, progress=False).engine
    bs = engine.config.block_size
    prompt = [5 + i % 50 for i in range(4 * bs - 4)]
    finals = _run(engine, {"bad": (prompt, SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True))},
                  {"bad": {"top_k": 2**63}})
    assert finals["bad"].error and engine.stats.request_faults == 1
    assert engine.kv.pool.num_used == 0
    again = _run(engine, {"after": (PROMPTS[0], GREEDY)})
    assert again["after"].error is None and len(again["after"].outputs[0].token_ids) == GREEDY.max_tokens


def test_an_engine_that_cannot_run_a_step_stops_and_fails_no_request(model_dir: Path, monkeypatch) -> None:
    """A lost device: every step raises, its own check too. The engine stops at once (its
    requests move on with the worker's restart) rather than failing them as faults."""
    engine = _llm(model_dir).engine

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for n in (1, 2):  # one request alone in its step, then two
        for i in range(n):
            engine.add_request(f"r{n}{i}", PROMPTS[i], GREEDY)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
        assert engine.stats.request_faults == 0


def test_an_engine_that_fails_every_request_stops_instead_of_failing_them_forever(model_dir: Path,
                                                                                  monkeypatch) -> None:
    """Its own check runs, but every request's row fails: past MAX_FAULT_STREAK such steps the
    engine is what is broken, and it stops."""
    engine = _llm(model_dir).engine
    real = engine.runner.execute

    def clients_fail(rows: list[Any], **kw: object) -> object:
        if any(not r.request.request_id.startswith("pdserve-") for r in rows):
            raise RuntimeError("device half lost")
        return real(rows, **kw)

    monkeypatch.setattr(engine.runner, "execute", clients_fail)
    faulted = 0
    with pytest.raises(RuntimeError, match="device half lost"):
        for i in range(MAX_FAULT_STREAK + 1):
            engine.add_request(f"r{i}", PROMPTS[0], GREEDY)
            faulted += sum(out.error is not None for out in engine.step())
    assert faulted == MAX_FAULT_STREAK
    # The engine's own checks gave their blocks back; the last step's request holds its own.
    assert engine.kv.pool.num_used == len(engine.kv.blocks_of(f"r{MAX_FAULT_STREAK}")) == 1


def test_the_async_engine_raises_the_fault_to_its_caller_and_stays_healthy(model_dir: Path) -> None:
    want = _clean(model_dir)
    engine = AsyncEngine(_llm(model_dir).engine).start()

    async def collect(rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, prompt, params):
            if rid == "bad" and not tokens:  # in the engine now (its first token is out): slip the value in
                await engine.call(lambda e: _slip(e, rid, {"top_k": 2**63}))
            tokens += out.outputs[0].token_ids
        return tokens

    async def main() -> list[object]:
        bad = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
        jobs = [collect(f"ok{i}", p, GREEDY) for i, p in enumerate(PROMPTS)] + [collect("bad", [20, 21], bad)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 60)

    try:
        results = asyncio.run(main())
        assert results[:3] == [want[f"ok{i}"] for i in range(3)]
        assert isinstance(results[3], RequestFaultError), results[3]
        # A final output reaches its caller before the engine thread ends its job: give it a moment.
        deadline = time.monotonic() + 10
        while engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.healthy and engine.num_in_flight == 0
        assert asyncio.run(asyncio.wait_for(collect("after", PROMPTS[1], GREEDY), 60)) == want["ok1"]
    finally:
        engine.close()


@pytest.mark.parametrize("rows", [1, 2])
def test_the_poison_row_seam_fails_its_running_requests_alone(model_dir: Path, rows: int) -> None:
    """What the chaos scenarios (k, k2) inject into a decode worker: from the next step, one of
    its requests' row raises in every step, another one's too when injected twice; those
    requests alone fail, the others are whole."""
    from pdserve.workers import fault_seam

    want = _clean(model_dir)
    engine = AsyncEngine(_llm(model_dir).engine).start()

    async def collect(rid: str, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, prompt, GREEDY):
            if rid == "ok0" and not tokens:
                for _ in range(rows):
                    await engine.call(fault_seam.poison_row)
            tokens += out.outputs[0].token_ids
        return tokens

    async def main() -> list[object]:
        jobs = [collect(f"ok{i}", p) for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), 60)

    try:
        results = dict(zip(want, asyncio.run(main())))
    finally:
        engine.close()
    failed = [rid for rid, got in results.items() if isinstance(got, RequestFaultError)]
    assert len(failed) == rows, results
    assert all(got == want[rid] for rid, got in results.items() if rid not in failed)


def test_the_engines_own_check_never_touches_a_request_named_like_it(model_dir: Path) -> None:
    """After a step whose only row failed, the engine checks itself with a one-token request of
    its own: under a fixed id, a client's (held) request of that name had its blocks freed by it."""
    engine = _llm(model_dir).engine
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("pdserve-engine-check", list(range(5, 45)), greedy, hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    held = list(engine.blocks_of("pdserve-engine-check"))
    assert held and engine.kv.pool.num_used == len(held)
    execute = engine.runner.execute

    def failing(rows: Any, **kw: Any) -> Any:
        if any(s.request.request_id == "bad" for s in rows):
            raise RuntimeError("a bad row")
        return execute(rows, **kw)

    engine.runner.execute = failing  # type: ignore[method-assign]
    engine.add_request("bad", [7, 8, 9], greedy)
    outs = [o for _ in range(3) for o in engine.step()]
    assert any(o.request_id == "bad" and o.error for o in outs)
    assert engine.blocks_of("pdserve-engine-check") == held and engine.kv.pool.num_used == len(held)
