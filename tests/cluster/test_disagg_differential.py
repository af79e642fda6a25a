"""Differential fuzz of the disaggregated path: random batches of requests served by a prefill
worker and one or two decode workers (the real services, KV over ZeroMQ on loopback, signed;
Ray handles replaced by `LocalActor`, every request handed off) give what the offline engine
gives for the same requests: token ids, text, finish and stop reasons token for token (greedy,
and seeded sampling: a seeded request's tokens depend on its seed only), logprobs and prompt
logprobs within 1e-4. Some requests are dropped by their client part-way: what they got is a
prefix of the offline answer, the others are untouched, and every block, KV registration and
job is freed on both sides.

What varies, to stress the handoff: prompt lengths at and around block-size multiples (1,
bs-1, bs, bs+1, 2bs, ...), prefixes shared between requests (prefix-cache hits on either
side), chunked prefill on the prefill worker, pools small enough that admission waits or
preempts (either side), n-gram speculation on the decode workers, max_tokens 1 (the prefill
worker runs it alone), stop strings and stop token ids, n > 1 (the gateway's split into seeded
samples), logprobs and prompt logprobs, penalties.

A few seeded cases run in the suite; `PDSERVE_PD_FUZZ_CASES=N` (and `PDSERVE_PD_FUZZ_SEED`)
runs more by hand. A failure names its seed and prints the case.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalActor, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.actors import DecodeService, PrefillService, WorkerService
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import RouterConfig
from pdserve.workers.config import EngineConfig
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampler import seeded_at
from pdserve.workers.sampling_params import sample_seed
from pdserve.workers.tiny.builder import TinyModelSpec

CASES = int(os.environ.get("PDSERVE_PD_FUZZ_CASES", "8"))
FIRST_SEED = int(os.environ.get("PDSERVE_PD_FUZZ_SEED", "0"))
MAX_MODEL_LEN = 160
MAX_PROMPT = 120
TOL = 1e-4
REQUEST_TIMEOUT_S = 30.0  # a hang fails the case (TimeoutError)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


@dataclasses.dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    abort_after: int | None = None  # the client leaves after this many deltas (of each sample)
    abort_at_s: float | None = None  # or this long after it asked, whatever it got by then
    second_wave: bool = False  # sent once every request of the first wave has ended


@dataclasses.dataclass
class Case:
    seed: int
    block_size: int
    prefill: dict[str, Any]  # engine settings of the prefill worker
    decode: dict[str, Any]  # of each decode worker
    num_decode: int
    requests: list[Req]

    def __str__(self) -> str:
        lines = [f"seed {self.seed}: block_size {self.block_size}, {self.num_decode} decode worker(s)",
                 f"  prefill {self.prefill}", f"  decode {self.decode}"]
        for i, r in enumerate(self.requests):
            lines.append(f"  r{i}: len {len(r.prompt)} abort_after {r.abort_after} abort_at_s {r.abort_at_s} "
                         f"second_wave {r.second_wave} prompt {r.prompt}")
            lines.append(f"       {r.params}")
        return "\n".join(lines)


def _lengths(rng: random.Random, bs: int) -> int:
    pick = rng.choice([1, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs, 2 * bs + 1, 3 * bs, 4 * bs + 1, MAX_PROMPT, 0])
    return pick if pick else rng.randint(2, MAX_PROMPT)


def _prompts(rng: random.Random, n: int, bs: int) -> list[list[int]]:
    """Random prompts, some sharing a prefix (at a block boundary or not), some repeating a
    motif (n-gram drafts are accepted)."""
    shared = [rng.randrange(5, 4000) for _ in range(MAX_PROMPT)]
    out: list[list[int]] = []
    for _ in range(n):
        length = min(_lengths(rng, bs), MAX_PROMPT)
        kind = rng.random()
        if out and kind < 0.1:  # an earlier prompt again: every block of it may be cached
            out.append(list(rng.choice(out)))
        elif kind < 0.4:  # a shared prefix, then its own tail
            cut = rng.choice([bs, 2 * bs, length, rng.randint(1, length)])
            own = [rng.randrange(5, 4000) for _ in range(MAX_PROMPT)]
            out.append((shared[:min(cut, length)] + own)[:length])
        elif kind < 0.55:
            motif = [rng.randrange(5, 4000) for _ in range(rng.randint(2, 6))]
            out.append((motif * MAX_PROMPT)[:length])
        else:
            out.append([rng.randrange(5, 4000) for _ in range(length)])
    return out


def _params(rng: random.Random, prompt_len: int, eos: int) -> SamplingParams:
    room = MAX_MODEL_LEN - prompt_len
    max_tokens = min(room, rng.choice([1, 1, 2, rng.randint(3, 24), rng.randint(3, 48), room]))
    kw: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.6)
    if rng.random() < 0.25:
        kw.update(logprobs=rng.randint(0, 3))
    if rng.random() < 0.2 and prompt_len > 1:
        kw.update(prompt_logprobs=rng.randint(0, 2))
    if rng.random() < 0.35:
        # Seeded: temperature alone (what `_draw_on_an_edge` can recompute, should a draw differ).
        kw.update(temperature=rng.choice([0.7, 1.0, 1.3]), seed=rng.randrange(1 << 31), n=rng.choice([1, 1, 2, 3]))
        return SamplingParams(**kw)
    kw.update(temperature=0.0)
    if rng.random() < 0.2:  # EOS likely: it may end a request at its first token (on the prefill worker)
        kw.update(logit_bias={eos: rng.choice([3.0, 6.0, 10.0])})
    if rng.random() < 0.15:
        kw.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    if rng.random() < 0.15 and max_tokens > 2:
        kw.update(min_tokens=rng.randint(1, max_tokens - 1))
    return SamplingParams(**kw)


def _with_stops(rng: random.Random, oracle: LLM, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """A stop string or token id that the request's offline answer meets (so it ends there)."""
    if params.max_tokens is None or params.max_tokens < 3 or rng.random() > 0.3:
        return params
    probe = oracle.generate([prompt], dataclasses.replace(params, n=1))[0].outputs[0]
    at = rng.randrange(len(probe.token_ids))
    if rng.random() < 0.5:
        return dataclasses.replace(params, stop_token_ids=[probe.token_ids[at]])
    text = probe.text
    if not text:
        return params
    start = rng.randrange(len(text))
    stop = text[start:start + rng.randint(1, 3)]
    return dataclasses.replace(params, stop=[stop], include_stop_str_in_output=rng.random() < 0.3)


def make_case(seed: int, oracle_of: Callable[[int], LLM]) -> Case:
    rng = random.Random(seed)
    bs = rng.choice([8, 16, 16])
    max_blocks = -(-MAX_MODEL_LEN // bs)
    prefill: dict[str, Any] = dict(
        enable_prefix_caching=rng.random() < 0.6,
        max_num_batched_tokens=rng.choice([bs, 24, 40, 2048]),
        num_kv_blocks=rng.choice([max_blocks, max_blocks + 2, 256]))
    decode: dict[str, Any] = dict(
        enable_prefix_caching=rng.random() < 0.6,
        max_num_batched_tokens=rng.choice([32, 2048]),
        num_kv_blocks=rng.choice([max_blocks, max_blocks + 1, max_blocks + 6, 256]))
    if rng.random() < 0.4:
        decode.update(speculative="ngram", num_speculative_tokens=rng.randint(1, 4), spec_max_batch_size=64,
                      spec_token_cost=0.001)
    prompts = _prompts(rng, rng.randint(1, 8), bs)
    oracle = oracle_of(bs)
    requests = []
    for p in prompts:
        params = _with_stops(rng, oracle, p, _params(rng, len(p), oracle.tokenizer.eos_token_id))
        abort = rng.random()
        abort_after = rng.randint(0, 3) if abort < 0.1 else None
        abort_at_s = rng.uniform(0, 0.05) if 0.1 <= abort < 0.18 else None
        requests.append(Req(p, params, abort_after, abort_at_s, second_wave=rng.random() < 0.3))
    return Case(seed, bs, prefill, decode, rng.choice([1, 1, 2]), requests)


def _samples(req: Req) -> list[SamplingParams]:
    """The gateway's split of an n > 1 request: n requests of one sample, seeded per sample."""
    p = req.params
    return [dataclasses.replace(p, n=1, seed=sample_seed(p.seed, j)) for j in range(p.n)]


@contextlib.contextmanager
def served(model_dir: Path, case: Case) -> Iterator[tuple[DisaggregatedBackend, PrefillService, list[DecodeService]]]:
    base = EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=case.block_size)
    services: list[PrefillService | DecodeService] = []
    try:
        prefill = PrefillService(dataclasses.replace(base, **case.prefill), 1)
        services.append(prefill)
        decode = []
        for _ in range(case.num_decode):
            decode.append(DecodeService(dataclasses.replace(base, **case.decode), 1, "127.0.0.1"))
            services.append(decode[-1])
        # Every request handed off (none prefilled on the decode worker for being short or for a backlog).
        router = Router(RouterConfig(local_prefill_threshold_tokens=0, max_prefill_backlog_tokens=0), case.block_size)
        backend = DisaggregatedBackend({"p0": LocalActor(prefill)},
                                       {f"d{i}": LocalActor(d) for i, d in enumerate(decode)}, router, poll_s=0.01)
        yield backend, prefill, decode
    finally:
        for s in services:
            s.close()


async def _one(backend: DisaggregatedBackend, rid: str, prompt: list[int], params: SamplingParams,
               req: Req) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    if req.abort_after == 0:
        return outs

    async def read() -> None:
        async with contextlib.aclosing(backend.generate(rid, prompt, params, REQUEST_TIMEOUT_S)) as stream:
            async for out in stream:
                outs.append(out)
                if req.abort_after is not None and len(outs) >= req.abort_after:
                    break  # the client leaves: closing the stream aborts the request on both workers

    if req.abort_at_s is None:
        await read()
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(read(), req.abort_at_s)
    return outs


async def serve_case(backend: DisaggregatedBackend, case: Case) -> list[list[list[RequestOutput]]]:
    """Each request's samples' deltas; the second wave's requests are sent once the first's ended
    (the decode workers' prefix caches hold what the first left)."""
    got: dict[tuple[int, int], list[RequestOutput]] = {}

    async def wave(second: bool) -> None:
        jobs = {(i, j): _one(backend, f"r{i}-{j}", r.prompt, sp, r)
                for i, r in enumerate(case.requests) if r.second_wave == second for j, sp in enumerate(_samples(r))}
        got.update(zip(jobs, await asyncio.gather(*jobs.values())))

    async def both() -> None:
        await wave(False)
        await wave(True)

    try:
        await asyncio.wait_for(both(), 60)
    finally:
        await backend.close()
    return [[got[i, j] for j in range(r.params.n)] for i, r in enumerate(case.requests)]


def _close(a: dict[int, float], b: dict[int, float], what: str) -> None:
    """Two logprob entries agree: the same tokens (but for ties at the cut) and values within TOL."""
    for t in a.keys() & b.keys():
        assert abs(a[t] - b[t]) < TOL, f"{what}: token {t}: {a[t]} != {b[t]}"
    for t in a.keys() ^ b.keys():  # only a near-tie at the top-N's edge may swap a token
        cut = min(min(a.values()), min(b.values()))
        assert abs((a[t] if t in a else b[t]) - cut) < TOL, f"{what}: {sorted(a.items())} != {sorted(b.items())}"


def _draw_on_an_edge(oracle: LLM, prompt: list[int], params: SamplingParams, before: list[int],
                     a: int, b: int) -> None:
    """A seed fixes a request's draws, not its logits (docs/api.md): the batch's shape moves a
    logit by float rounding, and a draw that falls on the edge between two tokens then picks the
    other. Asserts that this is what parted tokens `a` and `b` after `before`: they are neighbours
    in the CDF (token id order), and the draw of that position lies within 1e-6 of their edge."""
    assert abs(a - b) == 1, f"seeded tokens {a} and {b} after {before}: not neighbours in the CDF"
    model, seen = oracle.engine.model, []
    compute = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        seen.append(logits[-1].double())
        return logits

    model.compute_logits = capture  # type: ignore[method-assign]
    try:  # the logits after `before` (one row: the prompt's last position)
        oracle.generate([prompt + before], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        model.compute_logits = compute  # type: ignore[method-assign]
    logits = seen[0]
    cdf = ((logits - logits.max()) / params.temperature).exp().cumsum(0)
    u = torch.empty(1, dtype=torch.float64).uniform_(generator=seeded_at(torch.Generator(), params.seed,
                                                                          len(before))).item()
    edge = (cdf[min(a, b)] / cdf[-1]).item()
    assert abs(u - edge) < 1e-6, f"seeded tokens {a} and {b} after {before}: draw {u}, their edge at {edge}"


def check_sample(oracle: LLM, prompt: list[int], got: list[RequestOutput], want: Any, want_prompt_lp: Any,
                 params: SamplingParams, aborted: bool) -> None:
    tokens = [t for o in got for t in o.outputs[0].token_ids]
    if params.seed is not None:  # where a draw fell on an edge, what follows differs: compare up to it
        i = next((i for i, (a, b) in enumerate(zip(tokens, want.token_ids)) if a != b), None)
        if i is not None:
            _draw_on_an_edge(oracle, prompt, params, tokens[:i], tokens[i], want.token_ids[i])
            return
    if aborted:
        assert tokens == want.token_ids[:len(tokens)], f"an aborted request's tokens: {tokens} vs {want.token_ids}"
        return
    assert tokens == want.token_ids
    assert "".join(o.outputs[0].text for o in got) == want.text
    assert got[-1].finished and all(not o.finished for o in got[:-1])
    assert got[-1].outputs[0].finish_reason == want.finish_reason
    assert got[-1].outputs[0].stop_reason == want.stop_reason
    if params.logprobs is not None:
        lps = [lp for o in got for lp in o.outputs[0].logprobs or []]
        assert len(lps) == len(want.logprobs)
        for k, (a, b) in enumerate(zip(lps, want.logprobs)):
            _close(a, b, f"logprobs[{k}]")
    if params.prompt_logprobs is not None:
        plp: list[dict[int, float] | None] = [e for o in got for e in o.prompt_logprobs or []]
        assert len(plp) == len(want_prompt_lp) and plp[0] is None
        for k, (pa, pb) in enumerate(zip(plp[1:], want_prompt_lp[1:]), 1):
            assert pa is not None, f"prompt_logprobs[{k}] missing"
            _close(pa, pb, f"prompt_logprobs[{k}]")


def _state(service: WorkerService) -> dict[str, int]:
    e = service.engine
    return {"used_blocks": e.kv.pool.num_used, "unfinished": int(e.has_unfinished_requests()),
            "in_flight": service.async_engine.num_in_flight, "registered": service._registrations()}


def assert_all_freed(prefill: PrefillService, decode: list[DecodeService]) -> None:
    """Every block, job and KV registration is given back on both sides (aborts are fire and
    forget: within a deadline)."""
    services = [prefill, *decode]
    deadline = time.monotonic() + 10
    while True:
        states = [_state(s) for s in services]
        if all(not any(s.values()) for s in states):
            return
        assert time.monotonic() < deadline, f"left held after the case: {states}"
        time.sleep(0.01)


def _coverage(prefill: PrefillService, decode: list[DecodeService]) -> dict[str, int]:
    """What a case made the workers do (for a hunt's summary: that its cases reach the paths)."""
    p, ds = prefill.engine.stats, [d.engine.stats for d in decode]
    return {"prefill_computed": p.prompt_tokens_computed, "prefill_preemptions": p.preemptions,
            "decode_computed": sum(d.prompt_tokens_computed for d in ds),
            "decode_preemptions": sum(d.preemptions for d in ds),
            "decode_cached": sum(d.engine.snapshot().prompt_tokens_cached for d in decode),
            "prefill_cached": prefill.engine.snapshot().prompt_tokens_cached,
            "spec_accepted": sum(d.spec_accepted_tokens for d in ds),
            "transfer_failures": sum(getattr(d.worker, "num_transfer_failures", 0) for d in decode)}


def run_case(model_dir: Path, case: Case, oracle_of: Callable[[int], LLM]) -> dict[str, int]:
    oracle = oracle_of(case.block_size)
    want = oracle.generate([r.prompt for r in case.requests], [r.params for r in case.requests])
    with served(model_dir, case) as (backend, prefill, decode):
        got = asyncio.run(serve_case(backend, case))
        for i, (r, samples, w) in enumerate(zip(case.requests, got, want)):
            for j, outs in enumerate(samples):
                try:
                    aborted = r.abort_after is not None or r.abort_at_s is not None
                    check_sample(oracle, r.prompt, outs, w.outputs[j], w.prompt_logprobs, _samples(r)[j], aborted)
                except AssertionError as e:
                    raise AssertionError(f"request r{i} sample {j}: {e}") from None
        assert_all_freed(prefill, decode)
        return _coverage(prefill, decode)


@pytest.fixture(scope="module")
def oracle_of(model_dir: Path) -> Callable[[int], LLM]:
    made: dict[int, LLM] = {}

    def get(bs: int) -> LLM:
        if bs not in made:
            made[bs] = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=bs, num_kv_blocks=512,
                           enable_prefix_caching=False, progress=False)
        return made[bs]

    return get


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + CASES))
def test_disaggregated_serving_equals_offline(model_dir: Path, oracle_of: Callable[[int], LLM], seed: int) -> None:
    case = make_case(seed, oracle_of)
    try:
        run_case(model_dir, case, oracle_of)
    except BaseException:
        print(f"PDSERVE_PD_FUZZ_SEED={seed} PDSERVE_PD_FUZZ_CASES=1 reproduces:\n{case}")
        raise
