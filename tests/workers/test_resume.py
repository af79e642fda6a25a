"""A request resumed on another engine from what its client already has (its
worker died mid-stream) goes on exactly as the uninterrupted run: the same
tokens, text, finish and logprobs after the cut, for greedy, seeded, penalised
and stop-string requests, cut after any step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.engine import LLMEngine
from pdserve.workers.handoff import Resume
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import RequestOutputKind
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def engine(model_dir: Path) -> LLMEngine:
    return LLM(str(model_dir), max_model_len=512, num_kv_blocks=128, progress=False).engine


def deltas(eng: LLMEngine, prompt: list[int], params: SamplingParams,
           resume: Resume | None = None) -> list[RequestOutput]:
    eng.add_request("r", prompt, params.with_output_kind(RequestOutputKind.DELTA), resume=resume)
    outs: list[RequestOutput] = []
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            break
        outs += [o for o in eng.step() if o.request_id == "r"]
    assert outs and outs[-1].finished
    assert eng.kv.pool.num_used == 0 or eng.config.enable_prefix_caching
    return outs


def flat(outs: list[RequestOutput]) -> tuple[list[int], str, list[dict[int, float]]]:
    tokens: list[int] = []
    text, logprobs = "", []
    for o in outs:
        c = o.outputs[0]
        tokens += c.token_ids
        text += c.text
        logprobs += c.logprobs or []
    return tokens, text, logprobs


def resume_after(outs: list[RequestOutput]) -> Resume:
    tokens, text, _ = flat(outs)
    return Resume(tuple(tokens), len(text), outs[-1].outputs[0].cumulative_logprob)


PROMPT = torch.randint(5, 4000, (37,), generator=torch.Generator().manual_seed(3)).tolist()
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=24, ignore_eos=True),
    "penalties+logprobs": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4,
                                         frequency_penalty=0.5, presence_penalty=0.2, logprobs=2),
    "min_tokens": SamplingParams(temperature=0.7, seed=5, max_tokens=24, min_tokens=20),
}


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_request_goes_on_as_the_uninterrupted_run(model_dir: Path, name: str) -> None:
    params = CASES[name]
    expected = deltas(engine(model_dir), PROMPT, params)
    want_tokens, want_text, want_logprobs = flat(expected)
    assert len(expected) > 6
    other = engine(model_dir)
    for cut in (1, 2, len(expected) // 2, len(expected) - 1):
        rest = deltas(other, PROMPT, params, resume_after(expected[:cut]))
        tokens, text, logprobs = flat(expected[:cut] + rest)
        assert tokens == want_tokens, f"cut after {cut} deltas"
        assert text == want_text
        assert rest[-1].outputs[0].finish_reason == expected[-1].outputs[0].finish_reason
        if params.logprobs is not None:
            assert [list(e) for e in logprobs] == [list(e) for e in want_logprobs]
            for got, want in zip(logprobs, want_logprobs):
                assert got == pytest.approx(want, abs=1e-4)
            assert rest[-1].outputs[0].cumulative_logprob == pytest.approx(
                expected[-1].outputs[0].cumulative_logprob, abs=1e-3)


def test_resume_with_a_stop_string_cut_at_its_first_characters(model_dir: Path) -> None:
    """The stop string is found over the whole text (the resumed tokens' included),
    and the text handed out before the cut is not sent again."""
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, text, _ = flat(deltas(engine(model_dir), PROMPT, free))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    params = dataclasses.replace(free, stop=[stop])
    expected = deltas(engine(model_dir), PROMPT, params)
    want_tokens, want_text, _ = flat(expected)
    assert expected[-1].outputs[0].finish_reason == "stop" and not want_text.endswith(stop)
    other = engine(model_dir)
    for cut in range(1, len(expected)):
        rest = deltas(other, PROMPT, params, resume_after(expected[:cut]))
        tokens, text, _ = flat(expected[:cut] + rest)
        assert (tokens, text) == (want_tokens, want_text), f"cut after {cut} deltas"
        assert rest[-1].outputs[0].stop_reason == stop


def test_deltas_never_hand_out_the_start_of_a_stop_string(model_dir: Path) -> None:
    """A stop string over two tokens' text: the first token's part of it must not go out
    in a delta before the second shows it is a stop string (a delta cannot be taken back).
    The deltas add up to what the request's final output says (the text before the stop
    string), as OpenAI and vLLM answer, and every token still goes out as it comes."""
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = deltas(engine(model_dir), PROMPT, free)
    pieces = [o.outputs[0].text for o in plain]
    full = "".join(pieces)
    tried = 0
    for k in range(1, len(pieces) - 1):
        before = "".join(pieces[: k + 1])
        stop = before[-2:] + pieces[k + 1][:2]  # two characters of token k's text, two of k+1's
        if len(pieces[k]) < 2 or len(pieces[k + 1]) < 2 or full.find(stop) != len(before) - 2:
            continue
        params = dataclasses.replace(free, stop=[stop])
        want = full[: full.find(stop)]
        final = LLM(str(model_dir), max_model_len=512, num_kv_blocks=128, progress=False).generate(
            [PROMPT], params)[0].outputs[0]
        assert final.text == want and final.stop_reason == stop
        got = deltas(engine(model_dir), PROMPT, params)
        tokens, text, _ = flat(got)
        assert text == want, f"stop {stop!r}: the deltas handed out {text!r}"
        assert len(tokens) == k + 2 and got[-1].outputs[0].stop_reason == stop
        # Held back is only what could start the stop string: never more than 3 characters.
        sent = 0
        for i, o in enumerate(got[:-1]):
            sent += len(o.outputs[0].text)
            assert sent >= len("".join(pieces[: i + 1])) - (len(stop) - 1)
        tried += 1
        if tried == 3:
            break
    assert tried, f"no two neighbouring tokens of two characters or more in {pieces!r}"


def test_a_resume_that_cannot_be_right_is_refused(model_dir: Path) -> None:
    eng = engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="no room"):
        eng.add_request("a", PROMPT, params, resume=Resume((7, 8, 9, 10), 0))
    with pytest.raises(ValueError, match="characters"):
        eng.add_request("b", PROMPT, params, resume=Resume((7,), 10_000))
    with pytest.raises(ValueError, match="token"):
        eng.add_request("c", PROMPT, params, resume=Resume((10**9,), 0))
    with pytest.raises(ValueError):
        Resume((), 0)
    assert not eng.has_unfinished_requests() and eng.kv.pool.num_used == 0


def test_a_later_try_replaces_the_earlier_one_and_late_aborts_spare_it(model_dir: Path) -> None:
    """The gateway gave up on try 0 (its stream broke) and sent try 1 to the same
    worker: try 0 ends there (blocks freed), try 1 runs; try 0's abort, arriving
    late, leaves try 1 alone; the same try twice is refused."""
    import asyncio

    from pdserve.cluster.token_collector import TokenStreamCollector
    from pdserve.workers.async_engine import AsyncEngine, RequestAbortedError
    from pdserve.workers.handoff import ServeRequest

    # Long enough that try 0 is still running when its duplicate and try 1 come (40 tokens
    # of the tiny model could be over in the 0.05 s the test waited).
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    prompt = list(range(5, 25))
    want = LLM(str(model_dir), max_model_len=512, num_kv_blocks=128, progress=False).generate(
        [prompt], params)[0].outputs[0].token_ids

    async def run(ae: AsyncEngine) -> list[int]:
        collector = TokenStreamCollector()
        collector.open("r", prompt, 30.0)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def read() -> list[int]:
            return [t async for o in collector.consume("r", collector.watch("r", done)) for t in o.outputs[0].token_ids]

        def try_(attempt: int, resume: Resume | None = None) -> asyncio.Future[None]:
            req = ServeRequest("r", tuple(prompt), params, 30.0, collector.address, attempt=attempt, resume=resume)
            return asyncio.ensure_future(ae.serve(req))

        try:
            reader = asyncio.ensure_future(read())
            first = try_(0)
            while ae.num_in_flight == 0:  # try 0 is on the engine
                await asyncio.sleep(0.005)
            with pytest.raises(ValueError, match="already running"):
                await try_(0)
            second = try_(1, collector.next_attempt("r").resume)
            with pytest.raises(RequestAbortedError, match="superseded"):
                await first
            ae.abort("r", attempt=0)  # late: try 1 is spared
            await second
            if not done.done():  # (the reader may have had the final delta and ended first)
                done.set_result(None)
            return await reader
        finally:
            await collector.close()

    with AsyncEngine(engine(model_dir)) as ae:
        assert asyncio.run(run(ae)) == want
        assert ae.engine.kv.pool.num_used == 0 or ae.engine.config.enable_prefix_caching
        assert ae.num_in_flight == 0
