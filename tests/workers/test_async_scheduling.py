"""Async scheduling (workers/in_flight.py): the next step launched before this one's tokens
reach the host. The oracle is the synchronous engine: the same requests give the same tokens,
text, finish reasons and logprobs, token for token, whatever ends them (stop strings, stop
tokens, max_tokens, min_tokens, aborts), through preemption, seeded sampling, and the steps
that must land before the next (penalties, grammars, speculation). On a CPU the overlap buys
nothing (the step is the host's own work); these tests force it on to check the bookkeeping
that a GPU relies on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from async_engines import SPEC
from async_engines import engine as _engine
from async_engines import prompts as _prompts
from async_engines import run as _run

from pdserve import SamplingParams
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.engine import LLMEngine
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)






def _summary(out: RequestOutput) -> tuple[object, ...]:
    c = out.outputs[0]
    return c.token_ids, c.text, c.finish_reason, c.stop_reason


def _same(sync: dict[str, RequestOutput], overlapped: dict[str, RequestOutput]) -> None:
    assert sync.keys() == overlapped.keys()
    for rid in sync:
        assert _summary(overlapped[rid]) == _summary(sync[rid]), rid


def _both(model_dir: Path, requests: dict[str, tuple[list[int] | str, SamplingParams]],
          **kw: object) -> tuple[dict[str, RequestOutput], dict[str, RequestOutput], LLMEngine]:
    sync = _run(_engine(model_dir, False, **kw), requests)
    engine = _engine(model_dir, True, **kw)
    return sync, _run(engine, requests), engine


def _free(engine: LLMEngine) -> None:
    """No request holds a block (cached blocks nobody references are free)."""
    assert engine.kv.pool.num_used == 0
    assert not engine.kv.req_blocks


def test_greedy_is_the_same_token_for_token_and_the_steps_overlap(model_dir: Path) -> None:
    prompts = _prompts([5, 17, 40, 3, 64, 29, 11, 90])
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=8 + 7 * i, ignore_eos=True))
                for i, p in enumerate(prompts)}
    computed = {False: 0, True: 0}
    finals = {}
    for overlap in (False, True):
        engine = _engine(model_dir, overlap)
        engine.step_observers.append(lambda s, o=overlap: computed.__setitem__(o, computed[o] + s.scheduled_tokens))
        finals[overlap] = _run(engine, requests)
    sync, overlapped = finals[False], finals[True]
    _same(sync, overlapped)
    # No row past a request's last token: the token in flight that max_tokens makes its last
    # gets no successor.
    assert computed[True] == computed[False]
    assert all(o.outputs[0].finish_reason == "length" for o in overlapped.values())
    assert [len(overlapped[f"r{i}"].outputs[0].token_ids) for i in range(8)] == [8 + 7 * i for i in range(8)]
    # Nearly every step was launched with the one before it in flight.
    assert engine.overlapped_steps >= engine.stats.steps - 3
    _free(engine)


def test_stop_strings_stop_tokens_and_min_tokens_end_it_where_the_sync_engine_does(model_dir: Path) -> None:
    """Stops found only when a step lands: the row the next step computed for the request is
    dropped, its token never appended."""
    prompts = _prompts([9, 21, 33, 14], seed=1)
    free_run = _run(_engine(model_dir, False), {
        f"p{i}": (p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)})
    ids0, text1 = free_run["p0"].outputs[0].token_ids, free_run["p1"].outputs[0].text
    stop_str = text1[len(text1) // 2 : len(text1) // 2 + 3]
    assert stop_str.strip(), f"no text to stop on: {text1!r}"
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {
        "stop_token": (prompts[0], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids0[11]])),
        "stop_string": (prompts[1], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str])),
        "stop_string_kept": (prompts[1], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str],
                                                        include_stop_str_in_output=True)),
        "min_tokens": (prompts[0], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20,
                                                  stop_token_ids=[ids0[11]])),
        "one_token": (prompts[2], SamplingParams(temperature=0.0, max_tokens=1)),
        "long": (prompts[3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    }
    sync, overlapped, engine = _both(model_dir, requests)
    _same(sync, overlapped)
    assert overlapped["stop_token"].outputs[0].finish_reason == "stop"
    assert len(overlapped["stop_token"].outputs[0].token_ids) <= 12
    assert overlapped["stop_string"].outputs[0].stop_reason == stop_str
    assert len(overlapped["min_tokens"].outputs[0].token_ids) >= 20
    assert engine.overlapped_steps > 0
    _free(engine)


def test_seeded_sampling_and_logprobs_are_the_same(model_dir: Path) -> None:
    """A seeded draw depends on its position: the token in flight counts before it."""
    prompts = _prompts([12, 30, 7], seed=2)
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {
        f"s{i}": (p, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=24,
                                    ignore_eos=True, logprobs=3)) for i, p in enumerate(prompts)}
    requests["greedy"] = (prompts[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))
    sync, overlapped, _ = _both(model_dir, requests)
    _same(sync, overlapped)
    for rid in requests:
        want, got = sync[rid].outputs[0].logprobs, overlapped[rid].outputs[0].logprobs
        assert want is not None and got is not None and len(want) == len(got) == 24
        for w, g in zip(want, got):
            assert w.keys() == g.keys()
            assert all(abs(w[k] - g[k]) < 1e-4 for k in w)


def test_preemption_gives_the_same_tokens(model_dir: Path) -> None:
    prompts = _prompts([40, 70, 33, 90, 55, 61, 47, 80], seed=3)
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
                for i, p in enumerate(prompts)}
    # 8 requests need ~8 * 9 blocks at the end; 40 cannot hold them at once.
    sync, overlapped, engine = _both(model_dir, requests, num_kv_blocks=40, max_model_len=160)
    _same(sync, overlapped)
    assert engine.stats.preemptions > 0
    assert engine.overlapped_steps > 0
    _free(engine)


def test_steps_that_need_their_tokens_on_the_host_land_first(model_dir: Path) -> None:
    """Penalties and grammars shape the next step from this one's tokens; they chain nothing,
    and the plain requests beside them keep their tokens."""
    prompts = _prompts([15, 25, 35], seed=4)
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {
        "penalised": (prompts[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                 repetition_penalty=1.3, frequency_penalty=0.5)),
        "plain": (prompts[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
        "choice": (prompts[2], SamplingParams(temperature=0.0, max_tokens=30,
                                             structured_outputs={"choice": ["yes please", "no thanks"]})),
    }
    sync, overlapped, _ = _both(model_dir, requests)
    _same(sync, overlapped)
    assert overlapped["choice"].outputs[0].text in ("yes please", "no thanks")


def test_speculation_overlaps_while_dormant_and_drafts_when_the_batch_shrinks(model_dir: Path) -> None:
    """Four requests with the n-gram speculator, drafts only at 2 decoding requests or fewer:
    while all four decode the speculator is dormant and the steps overlap; as they finish, the
    step before the first draft lands first and the drafts come from the host's tokens. Tokens
    equal the synchronous speculative engine's and the plain engine's, token for token."""
    base = _prompts([8, 6, 9, 7], seed=5)
    prompts = [p * 6 for p in base]  # repetitive: the n-gram proposer finds drafts
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {
        f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, (12, 20, 48, 56)))}
    plain = _run(_engine(model_dir, False), requests)
    spec = dict(speculative="ngram", num_speculative_tokens=3, spec_max_batch_size=2, spec_token_cost=0.01)
    sync, overlapped, engine = _both(model_dir, requests, **spec)
    _same(plain, overlapped)
    _same(sync, overlapped)
    assert engine.async_scheduling and engine.overlapped_steps > 0
    assert engine.stats.spec_drafts > 0 and engine.stats.spec_accepted_tokens > 0
    _free(engine)


def test_an_abort_mid_flight_frees_its_blocks_and_leaves_the_rest_unchanged(model_dir: Path) -> None:
    prompts = _prompts([20, 30, 40], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    requests: dict[str, tuple[list[int] | str, SamplingParams]] = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    full = _run(_engine(model_dir, False), requests)

    def abort_r1(engine: LLMEngine, step: int) -> None:
        if step == 6:
            assert engine.in_flight  # r1's next token is on the device
            engine.abort("r1")

    engine = _engine(model_dir, True)
    got = _run(engine, requests, on_step=abort_r1)
    for rid in ("r0", "r2"):
        assert _summary(got[rid]) == _summary(full[rid])
    cut = got["r1"].outputs[0]
    assert cut.finish_reason == "abort"
    assert 0 < len(cut.token_ids) < 32 and cut.token_ids == full["r1"].outputs[0].token_ids[: len(cut.token_ids)]
    _free(engine)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_an_abort_while_drafts_are_verified_frees_the_request_once(model_dir: Path, prefix_caching: bool) -> None:
    """A verifying step is in flight between two `step()` calls, where a served engine runs its
    aborts (a client gone, a deadline). Its tokens were then appended to the finished request:
    with prefix caching a completed block's lookup of the freed blocks raised (a KeyError that
    killed a served worker's engine thread), without it the request got a second final output."""
    engine = _engine(model_dir, True, enable_prefix_caching=prefix_caching, speculative="ngram",
                     num_speculative_tokens=3, spec_max_batch_size=8, spec_token_cost=0.01)
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate((8, 6, 9)):  # repetitive prompts: the n-gram proposer drafts
        engine.add_request(f"r{i}", torch.randint(5, 4000, (n,), generator=g).tolist() * 6,
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    aborted = None
    finals: dict[str, list[str | None]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        flight = engine._in_flight
        if aborted is None and flight is not None and flight.result.spec:
            aborted = flight.result.spec[0].scheduled.request.request_id  # its drafts are being verified
            engine.abort(aborted)
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out.outputs[0].finish_reason)
    assert aborted is not None, "no verifying step was caught in flight"
    assert finals[aborted] == ["abort"] and all(len(f) == 1 for f in finals.values()), finals
    assert engine.kv.pool.num_used == 0 or prefix_caching
    assert not engine.has_unfinished_requests()


def test_an_id_reused_at_once_after_a_silent_abort_is_a_new_request(model_dir: Path) -> None:
    """abort(output=False) lets the caller reuse the id at once, while the old request's row is
    still in flight: the new request's tokens are its own."""
    old, new = _prompts([25, 18], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = _run(_engine(model_dir, False), {"x": (new, params)})["x"]
    engine = _engine(model_dir, True)
    engine.add_request("x", old, params)
    for _ in range(4):
        engine.step()
    assert engine.in_flight
    engine.abort("x", output=False)
    got = _run(engine, {"x": (new, params)})["x"]
    assert _summary(got) == _summary(want)
    _free(engine)


def test_a_prefill_worker_sees_only_the_kv_of_steps_that_landed(model_dir: Path) -> None:
    """A held (hold_kv) request's prefill progress counts the tokens of landed steps only: a
    prefill worker sends blocks as they are reported, and a step in flight has not written its KV."""
    prompt = _prompts([100], seed=8)[0]
    engine = _engine(model_dir, True, max_num_batched_tokens=32)
    engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    reported: list[tuple[int, bool]] = []
    landed = 0
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        progress = engine.prefill_progress("p")
        assert progress is not None
        reported.append(progress)
        # What landed: every step but the one in flight, 32 prompt tokens each.
        landed = min(100, 32 * (engine.stats.steps - engine.in_flight))
        assert progress[0] <= landed
    assert reported[0] == (0, False)  # the first chunk is in flight
    assert reported[-1] == (100, True)
    assert [c for c, _ in reported] == sorted(c for c, _ in reported)
    engine.release("p")
    _free(engine)


def test_the_worker_thread_streams_the_same_tokens(model_dir: Path) -> None:
    """The AsyncEngine's loop delivers a step late and does not block while one is in flight."""
    prompts = _prompts([10, 44, 27], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = _run(_engine(model_dir, False), {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    engine = AsyncEngine(_engine(model_dir, True)).start()

    async def collect(rid: str, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, prompt, params):
            tokens += out.outputs[0].token_ids  # deltas
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.wait_for(
            asyncio.gather(*(collect(f"r{i}", p) for i, p in enumerate(prompts))), timeout=60)

    try:
        got = asyncio.run(main())
    finally:
        engine.close()
    assert got == [want[f"r{i}"].outputs[0].token_ids for i in range(3)]
