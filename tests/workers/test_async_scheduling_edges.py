"""Async scheduling edge cases (workers/in_flight.py) the main file does not cover. The oracle is
the synchronous engine, or a block-accounting invariant."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from async_engines import SPEC, Requests
from async_engines import engine as _engine
from async_engines import prompts as _prompts
from async_engines import run as _run
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.request import Request
from pdserve.workers.sampler import SamplingBatch
from pdserve.workers.scheduler import SchedulerOutput
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)






def _summary(out: RequestOutput) -> tuple[object, ...]:
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason, out.num_cached_tokens, out.error is None


def _same(sync: dict[str, RequestOutput], overlapped: dict[str, RequestOutput]) -> None:
    assert sync.keys() == overlapped.keys()
    for rid in sync:
        assert _summary(overlapped[rid]) == _summary(sync[rid]), rid


def _free(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_used == 0
    assert not engine.kv.req_blocks
    assert not engine.scheduler.requests


def test_usage_and_cache_events_count_no_dropped_row(model_dir: Path) -> None:
    prompts = _prompts([9, 21, 33, 14, 32, 16], seed=1)
    free_run = _run(_engine(model_dir, False), {
        f"p{i}": (p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)})
    ids0, text1 = free_run["p0"].outputs[0].token_ids, free_run["p1"].outputs[0].text
    stop_str = text1[len(text1) // 2 : len(text1) // 2 + 3]
    requests: Requests = {
        "stop_token": (prompts[0], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids0[11]])),
        "stop_string": (prompts[1], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str], logprobs=2)),
        "len": (prompts[2], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)),
        "b32": (prompts[4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
        "b16": (prompts[5], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
    }
    got = {}
    for overlap in (False, True):
        engine = _engine(model_dir, overlap, record_kv_events=True)
        finals = _run(engine, requests)
        events = engine.take_kv_events()
        got[overlap] = (finals, engine.stats.generation_tokens, engine.stats.prompt_tokens_computed,
                        sorted((e.kind.value, e.block_hash) for e in events if e.kind.value == "stored"))
        _free(engine)
    _same(got[False][0], got[True][0])
    assert got[True][1:] == got[False][1:]


def test_prefix_hits_admitted_while_a_step_is_in_flight(model_dir: Path) -> None:
    """Prompts that end at a block boundary (16, 32) and their copies admitted a step or two later,
    while the first's step is in flight: the copies hit its cached blocks in both engines."""
    a, b, c = _prompts([32, 16, 47], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first: Requests = {"a": (a, params), "b": (b, params), "c": (c, params)}
    later: dict[int, Requests] = {1: {"a1": (a, params), "b1": (b, params)},
                                  2: {"a2": (a + [7], params), "c1": (c, params)}, 5: {"c2": (c[:33], params)}}
    sync = _run(_engine(model_dir, False), first, later)
    engine = _engine(model_dir, True)
    got = _run(engine, first, later)
    _same(sync, got)
    assert got["a1"].num_cached_tokens > 0
    _free(engine)


def test_n_samples_and_max_model_len(model_dir: Path) -> None:
    prompts = _prompts([30, 45], seed=12)
    outs = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=64, progress=False,
                  async_scheduling=overlap)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=None, ignore_eos=True, logprobs=1))
        outs[overlap] = [[(c.token_ids, c.finish_reason, c.cumulative_logprob) for c in r.outputs] for r in res]
        assert llm.engine.kv.pool.num_used == 0
    assert outs[True] == outs[False]
    assert all(len(c[0]) == 64 - len(p) for r, p in zip(outs[True], prompts) for c in r)


def test_json_schema_grammar_beside_plain_requests(model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    prompts = _prompts([12, 20, 28, 9], seed=13)
    requests: Requests = {
        "json": (prompts[0], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema})),
        "json_t": (prompts[1], SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                                              structured_outputs={"json": schema})),
        "plain": (prompts[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        "pen_min": (prompts[3], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=10, presence_penalty=0.5,
                                               logprobs=2)),
    }
    sync = _run(_engine(model_dir, False), requests, {3: {"late_json": (prompts[2], requests["json"][1])}})
    engine = _engine(model_dir, True)
    got = _run(engine, requests, {3: {"late_json": (prompts[2], requests["json"][1])}})
    _same(sync, got)
    _free(engine)


def test_prompt_logprobs_in_chunks_with_steps_in_flight(model_dir: Path) -> None:
    prompts = _prompts([70, 40, 25], seed=14)
    requests: Requests = {
        "pl": (prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)),
        "pl2": (prompts[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)),
        "plain": (prompts[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
    }
    sync = _run(_engine(model_dir, False, max_num_batched_tokens=32), requests)
    engine = _engine(model_dir, True, max_num_batched_tokens=32)
    got = _run(engine, requests)
    _same(sync, got)
    for rid in ("pl", "pl2"):
        want_lp, got_lp = sync[rid].prompt_logprobs, got[rid].prompt_logprobs
        assert want_lp is not None and got_lp is not None and len(want_lp) == len(got_lp)
        for w, g in zip(want_lp, got_lp):
            assert (w is None) == (g is None)
            if w is not None and g is not None:
                assert w.keys() == g.keys()
    _free(engine)


def test_draft_model_speculation_with_steps_in_flight(model_dir: Path,
                                                      make_model: Callable[[TinyModelSpec], Path]) -> None:
    draft = make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.05, seed=7))
    base = _prompts([8, 6, 9, 7], seed=15)
    requests: Requests = {
        f"r{i}": (p * 4, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1))
        for i, (p, n) in enumerate(zip(base, (10, 18, 30, 40)))}
    spec = dict(speculative="draft", draft_model=str(draft), num_speculative_tokens=3, spec_max_batch_size=2,
                spec_token_cost=0.01)
    sync = _run(_engine(model_dir, False, **spec), requests)
    engine = _engine(model_dir, True, **spec)
    got = _run(engine, requests)
    _same(sync, got)
    assert engine.overlapped_steps > 0 and engine.stats.spec_drafts > 0
    _free(engine)
    assert engine.spec is not None and getattr(engine.spec.proposer, "num_tracked", 0) == 0


def test_tight_pool_preemption_with_stops_and_shared_prefixes(model_dir: Path) -> None:
    shared = _prompts([32], seed=16)[0]
    tails = _prompts([3, 9, 17, 1, 12, 5], seed=17)
    free_run = _run(_engine(model_dir, False), {
        f"p{i}": (shared + t, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for i, t in enumerate(tails)})
    requests: Requests = {}
    for i, t in enumerate(tails):
        ids = free_run[f"p{i}"].outputs[0].token_ids
        requests[f"r{i}"] = (shared + t, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[5 + 4 * i]],
                                                        logprobs=1))
    sync = _run(_engine(model_dir, False, num_kv_blocks=24, max_model_len=96), requests)
    engine = _engine(model_dir, True, num_kv_blocks=24, max_model_len=96)
    got = _run(engine, requests)
    _same(sync, got)
    _free(engine)


def _fail_rows_from(engine: LLMEngine, rid: str, position: int) -> None:
    """Building the sampling inputs of any step with `rid`'s row for output token `position` or
    later raises (a value past int64, as workers/fault_seam.py poisons a row): the same rows in
    both engines, counted by the request's tokens, the one in flight included."""
    runner = engine.runner
    real = runner._sampling_batch

    def sampling_batch(reqs: list[Request], token_bitmask: torch.Tensor | None = None) -> SamplingBatch:
        if any(r.request_id == rid and r.num_output_tokens + r.num_pending >= position for r in reqs):
            raise OverflowError(f"injected: the row of request {rid} cannot be built")
        return real(reqs, token_bitmask)

    runner._sampling_batch = sampling_batch


def _fail_rows_while(engine: LLMEngine, rid: str, when: Callable[[], bool]) -> None:
    """Building the sampling inputs of any step with `rid`'s row raises while `when()`."""
    runner = engine.runner
    real = runner._sampling_batch

    def sampling_batch(reqs: list[Request], token_bitmask: torch.Tensor | None = None) -> SamplingBatch:
        if when() and any(r.request_id == rid for r in reqs):
            raise OverflowError(f"injected: the row of request {rid} cannot be built")
        return real(reqs, token_bitmask)

    runner._sampling_batch = sampling_batch


def test_a_row_that_fails_beside_a_step_in_flight_fails_as_in_the_sync_engine(model_dir: Path) -> None:
    """The step launched while another is in flight raises, and the rows that fail alone are
    failed. The step in flight lands first, as in the synchronous engine: a request it ends (a stop
    token) finishes as it should, not failed for a row it never needed; a request that does fail
    keeps the token it sampled there; the others keep their tokens."""
    prompts = _prompts([11, 19, 27], seed=18)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free_run = _run(_engine(model_dir, False), {f"p{i}": (p, greedy) for i, p in enumerate(prompts)})
    stop_at = free_run["p0"].outputs[0].token_ids[5]
    requests: Requests = {
        "stops": (prompts[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                             stop_token_ids=[stop_at])),
        "fails": (prompts[1], greedy),
        "ok": (prompts[2], greedy),
    }
    got = {}
    for overlap in (False, True):
        engine = _engine(model_dir, overlap)
        # `stops` ends at its 6th token: a row for a 7th raises; `fails`' 9th row raises.
        n_stop = free_run["p0"].outputs[0].token_ids.index(stop_at) + 1
        _fail_rows_from(engine, "stops", n_stop)
        _fail_rows_from(engine, "fails", 8)
        got[overlap] = (_run(engine, requests), engine.stats.generation_tokens, engine.stats.request_faults)
        _free(engine)
    sync, overlapped = got[False][0], got[True][0]
    assert sync["stops"].error is None and sync["stops"].outputs[0].finish_reason == "stop"
    assert sync["fails"].error is not None and len(sync["fails"].outputs[0].token_ids) == 8
    _same(sync, overlapped)
    assert got[True][1:] == got[False][1:]


def test_a_handoff_completed_while_the_decode_engine_has_a_step_in_flight(model_dir: Path) -> None:
    """Disaggregated: an async prefill engine (hold_kv) samples the first tokens; an async decode
    engine, decoding requests of its own, reserves blocks and completes the handoffs between its
    steps while one is in flight. Every request's tokens equal one synchronous engine's."""
    prompts = _prompts([40, 23, 70, 33, 17], seed=19)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=4, max_tokens=24, ignore_eos=True, logprobs=1)
    params = {"own0": greedy, "own1": seeded, "x0": greedy, "x1": seeded,
              "x2": SamplingParams(temperature=0.0, max_tokens=1)}
    prompt_of = dict(zip(params, prompts))
    want = _run(_engine(model_dir, False), {rid: (prompt_of[rid], params[rid]) for rid in params})

    prefill, decode = _engine(model_dir, True, max_num_batched_tokens=32), _engine(model_dir, True)
    for rid in ("own0", "own1"):
        decode.add_request(rid, prompt_of[rid], params[rid])
    handed = ("x0", "x1", "x2")
    for rid in handed:
        prefill.add_request(rid, prompt_of[rid], _first_only(params[rid]), hold_kv=True)
    firsts = {out.request_id: out for out in _drain(prefill)}
    finals: dict[str, RequestOutput] = {}
    for i in range(500):
        if i in (2, 3, 4) and decode.in_flight:
            rid = handed[i - 2]
            plan = decode.reserve(rid, prompt_of[rid], params[rid])
            assert plan is not None
            dst, cached = plan
            src, skip = prefill.blocks_of(rid), cached // prefill.config.block_size
            for (pk, pv), (dk, dv) in zip(prefill.kv_caches, decode.kv_caches):
                dk[torch.tensor(dst[skip:len(src)])] = pk[torch.tensor(src[skip:])]
                dv[torch.tensor(dst[skip:len(src)])] = pv[torch.tensor(src[skip:])]
            prefill.release(rid)
            first = firsts[rid].outputs[0]
            out = decode.complete_reservation(rid, first.token_ids[0],
                                              first.logprobs[0] if first.logprobs else None)
            if out is not None and out.finished:
                finals[rid] = out
        elif not decode.has_unfinished_requests():
            break
        for out in decode.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
    assert finals.keys() == want.keys()
    for rid in want:
        assert finals[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        assert finals[rid].outputs[0].finish_reason == want[rid].outputs[0].finish_reason, rid
    assert prefill.kv.pool.num_used == 0
    _free(decode)


def _first_only(p: SamplingParams) -> SamplingParams:
    """What a prefill worker samples: the first token."""
    return dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outs = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        outs += [o for o in engine.step() if o.finished]
    return outs


def test_the_worker_thread_aborts_and_closes_with_a_step_in_flight(model_dir: Path) -> None:
    """Clients that leave mid-stream (their request aborted on the engine thread while its next
    token is in flight) free their blocks; the others stream the synchronous engine's tokens;
    closing with a request still running fails it and leaves no block held by a live request."""
    import asyncio

    from pdserve.workers.async_engine import AsyncEngine, EngineDeadError

    prompts = _prompts([10, 44, 27, 31], seed=20)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _run(_engine(model_dir, False), {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    inner = _engine(model_dir, True)
    engine = AsyncEngine(inner).start()

    async def collect(rid: str, prompt: list[int], leave_after: int | None) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, prompt, params):
            tokens += out.outputs[0].token_ids
            if leave_after is not None and len(tokens) >= leave_after:
                break
        return tokens

    async def main() -> list[list[int]]:
        jobs = [collect("r0", prompts[0], None), collect("r1", prompts[1], 5), collect("r2", prompts[2], 12),
                collect("r3", prompts[3], None)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

    try:
        got = asyncio.run(main())
        assert got[0] == want["r0"].outputs[0].token_ids and got[3] == want["r3"].outputs[0].token_ids
        assert got[1] == want["r1"].outputs[0].token_ids[: len(got[1])]
        assert got[2] == want["r2"].outputs[0].token_ids[: len(got[2])]
        assert asyncio.run(engine.call(lambda e: (e.kv.pool.num_used, e.in_flight, e.has_unfinished_requests()))) \
            == (0, False, False)

        async def last() -> list[int]:
            return await collect("late", prompts[0], None)

        async def close_mid() -> object:
            task = asyncio.create_task(last())
            await asyncio.sleep(0.05)
            await asyncio.to_thread(engine.close)
            return await asyncio.gather(task, return_exceptions=True)

        result = asyncio.run(close_mid())
        assert isinstance(result, list)
        assert isinstance(result[0], (EngineDeadError, list)), result
    finally:
        engine.close()
    assert not inner.kv.req_blocks or set(inner.kv.req_blocks) <= {"late"}


def _no_drafts_without_their_last_token(engine: LLMEngine) -> None:
    """Every step verifies drafts only after the request's last token is on the host: a verifying
    row's input is that token, then the drafts (the row of a token in flight would take a draft's
    place there)."""
    real = engine.scheduler.schedule

    def schedule() -> SchedulerOutput:
        out = real()
        for s in out.scheduled:
            assert not (s.num_spec and s.request.num_pending), f"{s.request.request_id} verifies drafts mid-flight"
        return out

    engine.scheduler.schedule = schedule


def test_drafts_made_as_a_failed_step_lands_its_predecessor_are_verified_from_the_host(model_dir: Path) -> None:
    """The step in flight lands while the next one is judged row by row (it raised), and the
    speculator drafts as it lands; the rows that fail then shrink the batch to a size at which the
    speculator is dormant (the measured cost model wants a plain step at a batch it has not
    measured). A step must not chain while a request holds drafts: the next one verifies them, and
    a request whose token is in flight has no last token on the host to verify them from."""
    base = _prompts([8, 6, 9, 7, 5], seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests: Requests = {f"r{i}": (p * 4, greedy) for i, p in enumerate(base[:3])}
    late: dict[int, Requests] = {6: {"late": (base[3] * 4, greedy)}}
    spec: dict[str, object] = dict(speculative="ngram", num_speculative_tokens=3, spec_max_batch_size=8)
    got = {}
    for overlap in (False, True):
        engine = _engine(model_dir, overlap, **spec)
        assert engine.spec is not None
        # Drafts only at 4 running requests (a batch the cost model measured), plain steps otherwise.
        engine.spec.dormant = lambda batch: batch != 4
        # From when `late` is admitted (the batch grows to 4), r2's rows raise.
        scheduler = engine.scheduler
        _fail_rows_while(engine, "r2", lambda: "late" in scheduler.requests)
        _no_drafts_without_their_last_token(engine)
        got[overlap] = _run(engine, requests, late)
        _free(engine)
    _same(got[False], got[True])
    assert got[True]["r2"].error is not None
    assert all(got[True][rid].error is None for rid in ("r0", "r1", "late"))


def _late(engine: object, release: object) -> BaseException | None:
    """A request started now (deadline 3 s), `release()` called once it is open; what ended it."""
    import asyncio

    async def late() -> BaseException | None:
        try:
            async for _ in engine.generate("late", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True),  # type: ignore[attr-defined]
                                           timeout_s=3.0):
                pass
        except BaseException as e:  # noqa: BLE001 - what ended it is the finding
            return e
        return None

    async def main() -> BaseException | None:
        task = asyncio.ensure_future(late())
        await asyncio.sleep(0.3)  # it opens (and, started, steps)
        release()  # type: ignore[operator]
        return await task

    return asyncio.run(main())


def test_a_request_opened_as_the_engine_closes_is_failed_not_left_to_its_deadline(model_dir: Path) -> None:
    """close() queued the failing of every job, then stopped the thread. A request opened after
    that walk but while the thread still ran was taken (the engine looked healthy), its start
    queued behind the stop and never run: nothing ended it, and its client waited out the
    request's deadline. The window is held open: the thread is kept, inside its drain of
    commands, between the walk and its exit while the request opens."""
    import threading
    import time

    from pdserve.workers.async_engine import AsyncEngine, EngineDeadError

    engine = AsyncEngine(_engine(model_dir, False)).start()
    inside, gate, walked, release = (threading.Event() for _ in range(4))

    def blocker() -> None:  # the thread, in its drain, until close() has queued its commands
        inside.set()
        gate.wait(20)

    def hold() -> None:  # drained after the fail-all: the jobs walked, the thread alive
        walked.set()
        release.wait(10)

    engine._commands.put(blocker)
    assert inside.wait(10)
    closer = threading.Thread(target=engine.close, kwargs={"timeout_s": 30})
    closer.start()
    deadline = time.monotonic() + 10
    while engine._commands.qsize() < 2 and time.monotonic() < deadline:  # close's fail-all and wake-up
        time.sleep(0.01)
    engine._commands.put(hold)
    gate.set()
    assert walked.wait(10)
    t0 = time.monotonic()
    error = _late(engine, release.set)
    closer.join(30)
    assert isinstance(error, EngineDeadError), repr(error)
    assert time.monotonic() - t0 < 2.5


def test_a_request_stepping_as_the_engine_closes_is_failed_not_left_to_its_deadline(model_dir: Path) -> None:
    """The thread saw close()'s stop on its way back from a step and left without running what
    close() had queued (the failing of every job): a request in flight waited out its deadline
    (a reviewer's run sat 600 s on one). The step is held until close() has stopped the thread."""
    import threading
    import time

    from pdserve.workers.async_engine import AsyncEngine, EngineDeadError

    inner = _engine(model_dir, False)
    engine = AsyncEngine(inner).start()
    stepping, go = threading.Event(), threading.Event()
    step = inner.step

    def held_step() -> list[RequestOutput]:
        if inner.has_unfinished_requests():
            stepping.set()
            go.wait(20)
        return step()

    inner.step = held_step  # type: ignore[method-assign]

    runs: list[threading.Thread] = []

    def close_mid_step() -> None:
        def run() -> None:
            assert stepping.wait(10)
            closer = threading.Thread(target=engine.close, kwargs={"timeout_s": 30})
            closer.start()
            while not engine._stop.is_set():
                time.sleep(0.01)
            go.set()
            closer.join(30)

        runs.append(threading.Thread(target=run, daemon=True))
        runs[-1].start()

    t0 = time.monotonic()
    error = _late(engine, close_mid_step)
    assert isinstance(error, EngineDeadError), repr(error)
    assert time.monotonic() - t0 < 2.5
    # The job fails before close() has joined the engine thread: wait for it, or the module's
    # check of threads left running found that one still on its way out (1 run in 6 failed).
    runs[0].join(30)
    assert not runs[0].is_alive()
