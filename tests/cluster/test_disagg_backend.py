"""The disaggregated coordinator over real worker services (real engines, ZeroMQ
KV transport on loopback) in one process, Ray handles replaced by `LocalActor`."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import LocalActor, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.actors import DecodeService, EngineService, PrefillService
from pdserve.cluster.backend import ColocatedBackend
from pdserve.cluster.disagg_backend import DisaggregatedBackend
from pdserve.cluster.reports import LoadReport
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import RouterConfig, RoutingPolicy
from pdserve.workers.config import EngineConfig
from pdserve.workers.messages import KVEventBatch
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.stats import EngineSnapshot
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer.base import Transport

BS = 16


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


_services: list[PrefillService | DecodeService | EngineService] = []


@pytest.fixture(autouse=True)
def _close_services() -> Iterator[None]:
    yield
    while _services:
        _services.pop().close()


def cluster(model_dir: Path, policy: RoutingPolicy, prefill_blocks: int, num_prefill: int = 2,  # noqa: ANN201
            transport: str = "zmq", **engine_args: object):
    base = EngineConfig(model=str(model_dir), max_model_len=1024, block_size=BS, max_num_batched_tokens=1024,
                        **engine_args)  # type: ignore[arg-type]
    prefill = {f"p{i}": PrefillService(replace(base, num_kv_blocks=prefill_blocks), 1, Transport(transport))
               for i in range(num_prefill)}
    decode = DecodeService(replace(base, num_kv_blocks=1024), 1, "127.0.0.1", Transport(transport))
    _services.extend([*prefill.values(), decode])
    router = Router(RouterConfig(policy=policy), BS)
    backend = DisaggregatedBackend({k: LocalActor(v) for k, v in prefill.items()}, {"d0": LocalActor(decode)},
                                   router, poll_s=0.01)
    return backend, prefill, decode


async def run_all(backend: DisaggregatedBackend, prompts: list[list[int]], params: SamplingParams,
                  concurrency: int = 4) -> list[list[int]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, p: list[int]) -> list[int]:
        async with sem:
            tokens: list[int] = []
            async for out in backend.generate(f"r{i}", p, params, 60):
                tokens += out.outputs[0].token_ids
            return tokens

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await backend.close()


@pytest.mark.parametrize("transport", ["zmq", "nccl"])  # nccl runs its gloo path on CPU
def test_disaggregated_backend_greedy_equals_offline(model_dir: Path, transport: str) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (40, 90, 33, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    backend, prefill, decode = cluster(model_dir, RoutingPolicy.CACHE_AWARE, 256, transport=transport)
    got = asyncio.run(run_all(backend, prompts, params))
    offline = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False)
    assert got == [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    computed = sum(s.worker.engine.stats.prompt_tokens_computed for s in prefill.values())
    assert computed >= sum(map(len, prompts)) - 4 * BS
    assert decode.worker.engine.kv.pool.num_used == 0
    assert all(s.worker.engine.kv.pool.num_used == 0 for s in prefill.values())


RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd ef"]}, "maxItems": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.mark.parametrize("speculative", [None, "ngram"], ids=["plain", "ngram"])
def test_a_grammar_holds_exactly_across_the_handoff(model_dir: Path, speculative: str | None) -> None:
    """Structured outputs disaggregated: the prefill worker samples the first token under the
    schema, the decode worker replays it into its own matcher (and drafts and verifies under
    it): greedy tokens equal the offline engine's, and every answer validates."""
    import json

    import jsonschema

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (40, 90, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs={"json": RECORD})
    spec: dict[str, object] = {"speculative": speculative, "spec_max_batch_size": 64} if speculative else {}
    backend, prefill, decode = cluster(model_dir, RoutingPolicy.CACHE_AWARE, 256, num_prefill=1, **spec)
    got = asyncio.run(run_all(backend, prompts, params))
    offline = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False)
    want = offline.generate(prompts, params)
    assert got == [o.outputs[0].token_ids for o in want]
    for o in want:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), RECORD)
    assert sum(s.worker.engine.stats.prompt_tokens_computed for s in prefill.values()) > 0  # handed off
    assert decode.worker.engine.kv.pool.num_used == 0


@pytest.mark.parametrize(("mode", "proposer"), [("disaggregated", "ngram"), ("colocated", "ngram"),
                                                ("disaggregated", "draft")])
def test_speculating_workers_give_the_offline_greedy_tokens(model_dir: Path, mode: str, proposer: str,
                                                            make_model: Callable[[TinyModelSpec], Path]) -> None:
    """n-gram speculation on the served paths (disaggregated: the decode worker
    drafts and verifies; colocated: one worker does all), mixed with requests
    that turn it off: tokens equal offline without speculation."""
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(5, 4000, (7,), generator=g).tolist()
    prompts = [(motif * 10)[:60], torch.randint(5, 4000, (45,), generator=g).tolist(), (motif[::-1] * 9)[:50]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    per_request = [params, params, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, speculative=False)]
    spec: dict[str, object] = {"speculative": proposer, "spec_max_batch_size": 64}
    if proposer == "draft":  # the decode worker prefills the draft itself
        spec["draft_model"] = str(make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                                                       init_std=0.05, seed=7)))
    if mode == "disaggregated":
        backend, _, decode = cluster(model_dir, RoutingPolicy.CACHE_AWARE, 256, num_prefill=1, **spec)
        engine = decode.worker.engine
    else:
        worker = EngineService(EngineConfig(model=str(model_dir), max_model_len=1024, **spec), 1)  # type: ignore[arg-type]
        _services.append(worker)
        backend, engine = ColocatedBackend([LocalActor(worker)]), worker.engine

    async def run() -> list[list[int]]:
        async def one(i: int) -> list[int]:
            return [t async for out in backend.generate(f"s{i}", prompts[i], per_request[i], 60)
                    for t in out.outputs[0].token_ids]
        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            await backend.close()  # type: ignore[union-attr]

    got = asyncio.run(run())
    offline = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False)
    assert got == [o.outputs[0].token_ids for o in offline.generate(prompts, per_request)]
    assert engine.stats.spec_drafts > 0 and (engine.stats.spec_accepted_tokens > 0 or proposer == "draft")
    assert engine.kv.pool.num_used == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),  # first token goes out early
    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),  # the first token is the last
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["e"]),  # a stop string may cut it
    SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
], ids=["early", "max_tokens_1", "stop_string", "sampled_logprobs"])
def test_first_token_from_the_prefill_worker_streams_like_offline(model_dir: Path, params: SamplingParams) -> None:
    """The gateway sends the prefill worker's first token before the decode worker
    continues (lower TTFT); the stream's deltas still add up to the offline output."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (37, 70)]
    backend, _, decode = cluster(model_dir, RoutingPolicy.CACHE_AWARE, 256, num_prefill=1)
    early = params.max_tokens > 1 and not params.stop
    # Where the first token goes out early, the decode worker may not go on until
    # the client has it: a gateway that waited for decode would stall here (and the
    # test fail), and a fast decode worker cannot merge its tokens into the first delta.
    client_has_first = threading.Semaphore(0)
    gate_timeouts: list[str] = []
    complete = decode.worker.engine.complete_reservation

    def gated(request_id: str, *args: Any, **kwargs: Any) -> RequestOutput | None:
        if not client_has_first.acquire(timeout=20):
            gate_timeouts.append(request_id)
        return complete(request_id, *args, **kwargs)

    if early:
        decode.worker.engine.complete_reservation = gated  # type: ignore[method-assign]

    async def one(i: int, p: list[int]) -> tuple[list[RequestOutput], str, list[int]]:
        outs = []
        async for out in backend.generate(f"f{i}", p, params, 60):
            if not outs:
                client_has_first.release()
            outs.append(out)
        return outs, "".join(o.outputs[0].text for o in outs), [t for o in outs for t in o.outputs[0].token_ids]

    async def run() -> list[tuple[list[RequestOutput], str, list[int]]]:
        try:
            return [await one(i, p) for i, p in enumerate(prompts)]
        finally:
            await backend.close()

    got = asyncio.run(run())
    offline = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False).generate(prompts, params)
    for (outs, text, tokens), ref in zip(got, offline):
        assert tokens == ref.outputs[0].token_ids and text == ref.outputs[0].text
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == ref.outputs[0].finish_reason
        if params.logprobs:  # the first token's entry comes from the prefill worker, the rest from decode
            got_lp = [lp for o in outs for lp in o.outputs[0].logprobs or []]
            assert len(got_lp) == len(tokens)
            for a, b in zip(got_lp, ref.outputs[0].logprobs or []):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    assert gate_timeouts == []
    if early:
        assert all(len(outs[0].outputs[0].token_ids) == 1 and not outs[0].finished for outs, _, _ in got)
    assert decode.worker.engine.kv.pool.num_used == 0


def test_cache_aware_routing_computes_2x_fewer_prefill_tokens_than_round_robin(model_dir: Path) -> None:
    """8 groups x 16 requests sharing a 512-token prefix, 2 prefill workers whose
    pools each hold about half of the prefixes."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(5, 4000) for _ in range(512)] for _ in range(8)]
    prompts = [pre + [rng.randrange(5, 4000) for _ in range(32)] for pre in prefixes for _ in range(16)]
    rng.shuffle(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    computed = {}
    for policy in (RoutingPolicy.CACHE_AWARE, RoutingPolicy.ROUND_ROBIN):
        backend, prefill, decode = cluster(model_dir, policy, prefill_blocks=192)
        asyncio.run(run_all(backend, prompts, params))
        computed[policy] = sum(s.worker.engine.stats.prompt_tokens_computed for s in prefill.values()) + \
            decode.worker.engine.stats.prompt_tokens_computed
    assert computed[RoutingPolicy.ROUND_ROBIN] >= 2 * computed[RoutingPolicy.CACHE_AWARE], computed


def test_single_token_requests_stay_on_the_prefill_worker(model_dir: Path) -> None:
    """max_tokens 1 (classification, scoring a prompt with echo): the prefill
    worker runs the request alone; the decode worker reserves nothing and
    receives no KV. Tokens and prompt logprobs as offline."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (70, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    backend, prefill, decode = cluster(model_dir, RoutingPolicy.CACHE_AWARE, 256)

    async def main() -> list[RequestOutput]:
        outs = []
        try:
            for i, p in enumerate(prompts):
                got = [o async for o in backend.generate(f"s{i}", p, params, 60)]
                assert len(got) == 1 and got[0].finished
                outs.append(got[0])
        finally:
            await backend.close()
        return outs

    outs = asyncio.run(main())
    offline = LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False).generate(prompts, params)
    for got, want in zip(outs, offline):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        assert all(a is None and b is None or abs(a[t] - b[t]) < 1e-4
                   for a, b, t in zip(got.prompt_logprobs, want.prompt_logprobs, [None] + want.prompt_token_ids[1:])
                   if t is not None)
    assert decode.worker.engine.stats.prompt_tokens == 0  # never asked to hold or compute anything
    assert sum(s.worker.engine.stats.prompt_tokens_computed for s in prefill.values()) >= sum(map(len, prompts)) - BS
    assert all(s.worker.engine.kv.pool.num_used == 0 for s in prefill.values())


class _FlakyWorker:
    """A worker whose load report fails while `down` (dead, hung, restarting)."""

    def __init__(self, name: str) -> None:
        self.name, self.down, self.seq, self.incarnation = name, False, 0, "1"
        self.garbled = False  # the next report is not a LoadReport (a bug, a version skew)

    async def load(self, since: object = None) -> LoadReport:
        if self.down:
            raise RuntimeError(f"{self.name} is down")
        if self.garbled:
            self.garbled = False
            return "not a report"  # type: ignore[return-value]
        self.seq += 1
        return LoadReport(EngineSnapshot(free_blocks=64, total_blocks=64),
                          KVEventBatch(worker_id=self.name, log_id="", first_seq=0, next_seq=0,
                                       snapshot=True, events=()), self.incarnation)


def test_a_worker_that_answers_again_is_routed_to_again() -> None:
    """A worker whose report fails is taken out of routing at once, and back in as
    soon as it reports again (a restarted worker, a hiccup), without a redeploy."""
    p, d = _FlakyWorker("p0"), _FlakyWorker("d0")
    backend = DisaggregatedBackend({"p0": LocalActor(p)}, {"d0": LocalActor(d)}, Router(RouterConfig(), BS))

    async def main() -> list[tuple[bool, bool]]:
        seen = []
        for down in (False, True, False):
            d.down = down
            await backend._refresh()
            seen.append((backend.healthy, backend.router.loads["d0"].healthy))
        return seen

    assert asyncio.run(main()) == [(True, True), (False, False), (True, True)]


def test_the_poller_survives_anything_and_finds_restarted_and_missing_workers() -> None:
    """Each worker's poll loop goes on whatever a poll raises (a dead worker, an
    engine error, a report it cannot read); a worker not found when the gateway
    started is looked up until it exists; a restart (new incarnation) is counted."""
    p, d = _FlakyWorker("p0"), _FlakyWorker("d0")
    found: dict[str, LocalActor | None] = {"pdserve-decode-0": None}
    backend = DisaggregatedBackend({"p0": LocalActor(p)}, {"d0": None}, Router(RouterConfig(), BS), poll_s=0.01,
                                   names={"p0": "pdserve-prefill-0", "d0": "pdserve-decode-0"},
                                   lookup=lambda name: found.get(name))

    async def until(cond: Callable[[], bool]) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached in 5 s")

    async def main() -> None:
        try:
            await backend.start()
            assert backend.health().status == "unavailable"  # no decode worker yet
            found["pdserve-decode-0"] = LocalActor(d)  # it comes up
            await until(lambda: backend.health().status == "ok")
            d.garbled = True  # a report the gateway cannot use: out for a moment, then back
            await until(lambda: backend.events.lost == 1)
            await until(lambda: backend.health().status == "ok")
            d.down = True
            await until(lambda: backend.events.lost == 2 and backend.health().status == "unavailable")
            d.incarnation, d.down = "2", False  # Ray restarted it
            await until(lambda: backend.health().status == "ok")
            assert backend.events.readmitted == 2 and backend.events.restarted == 1
            assert all(not t.done() for t in backend._pollers)
        finally:
            await backend.close()

    asyncio.run(main())
