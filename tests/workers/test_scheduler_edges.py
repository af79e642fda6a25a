"""The scheduler at its boundaries: FCFS and starvation, tiny pools and budgets, the prefix
cache under pressure. A real KVCacheManager and the fake model of test_scheduler.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from factories import tiny_spec
from test_memory_plan import FakeProbe, MiB
from test_scheduler import BS, S, all_blocks_free, make_request, make_scheduler, run_to_completion, step

from pdserve import LLM
from pdserve.cluster.router.policy import WorkerLoad, WorkerRole
from pdserve.workers import engine_setup
from pdserve.workers.lifecycle import Lifecycle
from pdserve.workers.request import FinishReason, Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.scheduler import Scheduler
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def _handoff(sched: Scheduler, rid: str, first_token: int) -> bool:
    """A decode worker's handoff of a 7-token prompt (2 blocks) that decodes 2 tokens: blocks
    reserved and, if they were, its KV landed at once with the prefill worker's first token."""
    req = Request(rid, list(range(first_token, first_token + 2 * BS - 1)), SamplingParams(max_tokens=2),
                  max_tokens=2, life=Lifecycle(rid, 60.0, S.ROUTED))
    if sched.reserve_remote(req) is None:
        return False
    sched.complete_remote(req)
    req.append_token(5)
    sched.took_token(req, None)
    return True


def test_handoffs_that_arrive_later_do_not_starve_a_request_queued_on_a_decode_worker() -> None:
    """FCFS on a decode worker: a request that could not reserve queues to prefill there. Handoffs
    that arrive after it must not take, again and again, the blocks it waits for (each one lands
    at the head of the queue, holding its blocks): it runs once the handoffs before it are done.
    Before the fix the queued request never ran while handoffs kept coming."""
    sched = make_scheduler(num_blocks=8, max_num_seqs=8, budget=64)
    arrived = 0
    while _handoff(sched, f"h{arrived}", 100 * (arrived + 1)):  # the pool is all reserved
        arrived += 1
    local = make_request("local", 3 * BS, max_tokens=2)  # could not reserve: it prefills here
    local.life = Lifecycle("local", 60.0, S.ROUTED)
    sched.add(local)
    for _ in range(50):  # a handoff arrives as fast as blocks free up
        while _handoff(sched, f"h{arrived}", 100 * (arrived + 1)):
            arrived += 1
        step(sched)
        if local.finished:
            break
    assert local.finish_reason is FinishReason.LENGTH, "the queued request starved behind later handoffs"
    while sched.has_unfinished():
        step(sched)
    assert all_blocks_free(sched)


@pytest.mark.parametrize("spec", [{}, {"speculative": "ngram", "num_speculative_tokens": 3}])
def test_the_memory_profile_steps_no_sequence_past_max_model_len(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, object]) -> None:
    """The CUDA memory plan's profile step spreads max_num_batched_tokens over max_num_seqs
    sequences. No real step has a sequence past max_model_len (a prompt is shorter), so neither
    may the profile: with one sequence, a 64-token context and a 256-token budget it ran
    positions up to 255 through RoPE tables of 64 rows, and the engine failed to start
    (IndexError; on a GPU an out-of-bounds gather)."""
    probe = FakeProbe(total=64 * MiB, used_at_start=16 * MiB, weights=8 * MiB, activations=4 * MiB)
    monkeypatch.setattr(engine_setup, "memory_probe", lambda device: probe)
    llm = LLM(str(model_dir), progress=False, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=64,
              **spec)
    assert llm.engine.max_model_len == 64 and probe.steps >= 1
    out = llm.generate([list(range(5, 68))], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length"


def test_handoffs_that_fill_the_pool_to_a_block_boundary_still_decode() -> None:
    """Handoffs reserve the whole pool for prompts that end on a block boundary, and land. Each
    one's first decode step writes the token after its prompt, in a block it does not hold, and
    nothing runs that could give one back: before the fix none ever ran again (every step
    scheduled nothing, for ever). The reservation holds that token's slot too; a handoff that
    finds no room queues here (it prefills locally), as a decode worker does."""
    sched = make_scheduler(num_blocks=4, max_num_seqs=4, budget=64)
    reqs, landed = [], []
    for i in range(2):
        req = Request(f"h{i}", list(range(100 * i, 100 * i + 2 * BS)), SamplingParams(max_tokens=3), max_tokens=3,
                      life=Lifecycle(f"h{i}", 60.0, S.ROUTED))
        reqs.append(req)
        plan = sched.reserve_remote(req)
        if plan is None:
            sched.add(req)
            continue
        assert len(plan[0]) == 2, "the blocks that cover the prompt, for its KV to land in"
        landed.append(req)
    for req in landed:
        sched.complete_remote(req)
        req.append_token(5)
        sched.took_token(req, None)
    for _ in range(40):
        if not sched.has_unfinished():
            break
        step(sched)
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3 for r in reqs), \
        "stuck: each landed request waits for a block another holds"
    assert all_blocks_free(sched)


@pytest.mark.parametrize("lost", ["no_prefix_cache", "prompt_logprobs"])
def test_landed_handoffs_are_not_starved_by_a_local_prefill_that_cannot_fit_beside_them(lost: str) -> None:
    """A decode worker: a request that could not reserve prefills here in chunks while two
    handoffs' KV is on the way; they land (holding their blocks, queued) while it still runs. Its
    prompt cannot fit beside their blocks: it preempts itself, goes back to the head of the queue,
    and, its work lost (no prefix cache, or prompt logprobs, which skip it), was admitted again
    first, its chunk taking the whole token budget, step after step: the landed requests never
    ran, nothing freed a block, and all three waited for their deadlines (a hang served
    disaggregated, which tests/cluster/test_disagg_differential.py found)."""
    from pdserve.workers.kv.cache_manager import KVCacheManager
    from pdserve.workers.scheduler import SchedulerConfig

    sched = Scheduler(SchedulerConfig(8, 4), KVCacheManager(8, BS, enable_prefix_caching=lost == "prompt_logprobs"))
    handoffs = [Request(f"h{i}", list(range(100 * i, 100 * i + 2 * BS - 1)), SamplingParams(max_tokens=3),
                        max_tokens=3, life=Lifecycle(f"h{i}", 60.0, S.ROUTED)) for i in range(2)]
    assert all(sched.reserve_remote(h) is not None for h in handoffs)  # 2 blocks each: 4 of 8 left
    params = SamplingParams(max_tokens=2, prompt_logprobs=0 if lost == "prompt_logprobs" else None)
    local = Request("local", list(range(500, 500 + 5 * BS)), params, max_tokens=2,
                    life=Lifecycle("local", 60.0, S.ROUTED))  # 6 blocks with its output: never beside them
    sched.add(local)
    for _ in range(3):
        step(sched)
    for h in handoffs:  # their KV lands while the local prompt is half computed
        sched.complete_remote(h)
        h.append_token(1000)
        sched.took_token(h, None)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert [r.finish_reason for r in [*handoffs, local]] == [FinishReason.LENGTH] * 3, \
        f"stuck: waiting {[r.request_id for r in sched.waiting]}, running {[r.request_id for r in sched.running]}"
    assert all_blocks_free(sched)


def test_a_decode_workers_random_mix_of_handoffs_and_local_requests_all_finish() -> None:
    """Handoffs (reserved, landed some steps later or failed back to a local prefill), requests
    that could not reserve, aborts, on pools a few sequences big with prompts of every length:
    every request ends, with its tokens, no step stalls for good, and every block comes back."""
    import random

    for seed in range(30):
        rng = random.Random(seed)
        num_blocks = rng.randint(4, 12)
        sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=rng.randint(1, 5), budget=rng.randint(1, 24))
        longest = 4 * BS  # the pool holds one such sequence (num_blocks >= 4), as plan_kv sees to
        reqs: list[Request] = []
        in_flight: list[tuple[int, Request]] = []  # (step it lands at, request): KV on its way
        aborted: set[str] = set()
        for t in range(2000):
            if t < 60 and rng.random() < 0.4:
                n = rng.choice([rng.randint(1, longest - 1), BS * rng.randint(1, 3)])  # often block-aligned
                rid = f"q{len(reqs)}"
                req = Request(rid, list(range(1000 * len(reqs), 1000 * len(reqs) + n)),
                              SamplingParams(max_tokens=4), max_tokens=rng.randint(1, longest - n),
                              life=Lifecycle(rid, 60.0, S.ROUTED))
                reqs.append(req)
                if rng.random() < 0.7 and sched.reserve_remote(req) is not None:
                    in_flight.append((t + rng.randint(0, 3), req))
                else:
                    sched.add(req)
            for at, req in [f for f in in_flight if f[0] <= t]:
                in_flight.remove((at, req))
                if req.finished:
                    continue
                if rng.random() < 0.2:
                    sched.prefill_locally(req)
                    continue
                sched.complete_remote(req)
                req.append_token(1000)  # the prefill worker's first token (step() numbers them so)
                sched.took_token(req, FinishReason.LENGTH if req.max_tokens == 1 else None)
            if reqs and rng.random() < 0.02:
                victim = rng.choice(reqs)
                if not victim.finished:
                    sched.finish(victim, FinishReason.ABORT)
                    sched.release(victim.request_id)
                    aborted.add(victim.request_id)
            if sched.has_unfinished():
                step(sched)
            elif t >= 60 and not in_flight:
                break
        assert not sched.has_unfinished(), f"seed {seed}: stalled with {len(sched.waiting)} waiting"
        for r in reqs:
            if r.request_id not in aborted:
                assert r.finish_reason is FinishReason.LENGTH, f"seed {seed}: {r.request_id}"
                assert r.output_token_ids == [1000 + i for i in range(r.max_tokens)], f"seed {seed}: {r.request_id}"
        assert all_blocks_free(sched), f"seed {seed}"


def test_the_graphs_reserve_scales_the_profiled_step_by_its_own_tokens(model_dir: Path) -> None:
    """The CUDA graphs' reserve is the profile's activations scaled per token: by the tokens the
    profile step ran (63 here: one sequence under a 64-token context), not the budget (256), which
    the capped profile no longer runs (it would reserve a quarter of what the graphs take)."""
    from pdserve.workers import memory_plan
    from pdserve.workers.config import EngineConfig

    engine = LLM(str(model_dir), progress=False, max_model_len=64, num_kv_blocks=16).engine
    config = EngineConfig(model=str(model_dir), max_num_seqs=1, max_num_batched_tokens=256, max_model_len=64,
                          enforce_eager=False)
    probe = FakeProbe(total=64 * MiB, used_at_start=16 * MiB, weights=8 * MiB, activations=4 * MiB)
    memory = memory_plan.measure(config, probe, engine.model, None, engine.dtype, engine.device, 64)
    assert memory.activations == 4 * MiB + int(4 * MiB * 1 / 63)


def test_queued_prefill_tokens_of_a_preempted_request_whose_outputs_are_cached_is_not_negative() -> None:
    """A request preempted after decoding a while waits with its prompt and outputs cached (its
    blocks freed tail first stay in the prefix cache). Its prompt has nothing left to compute,
    but the queue counted `prompt - cached tokens` for it, below zero once the cache covered
    its outputs too: the worker reported negative queued prefill tokens, which the router's
    WorkerLoad refuses, so the gateway's poll of the worker failed and took it out of routing."""
    sched = make_scheduler(num_blocks=8, budget=64)
    a = make_request("a", 5, max_tokens=30)
    b = make_request("b", 5, max_tokens=30, first_token=100)
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        if step(sched).preempted:
            break
    assert list(sched.waiting) == [b] and b.num_output_tokens > BS, "b was preempted after decoding"
    assert sched.kv.find_cached_prefix(b)[1] > b.num_prompt_tokens, "its outputs are cached too"
    queued = sched.queued_prefill_tokens()
    assert queued == 0, f"every prompt token is computed or cached, got {queued}"
    WorkerLoad("w", WorkerRole.DECODE, queued_prefill_tokens=queued)  # what the gateway's poll builds

def test_cached_tokens_of_a_resumed_request_count_its_prompt_only() -> None:
    """A resumed request (another worker started it and died) computes prompt + the tokens its
    client already has; where this worker caches both (the same greedy request ran here), its
    cache hit reaches past the prompt. `num_cached_tokens` is the prompt tokens served from the
    cache (the API's usage.prompt_tokens_details.cached_tokens, the prefix-cache hits metric): it
    counted the output tokens too, more cached tokens than the prompt has."""
    sched = make_scheduler(num_blocks=16, budget=64)
    first = make_request("first", 5, max_tokens=12)
    sched.add(first)
    while sched.has_unfinished():
        step(sched)
    resumed = make_request("resumed", 5, max_tokens=16)
    for token in first.output_token_ids[:10]:  # what its client had (`token_append.resume_output`)
        resumed.append_token(token)
    sched.add(resumed)
    step(sched)
    assert sched.kv.find_cached_prefix(resumed)[1] > resumed.num_prompt_tokens, "its outputs were cached here"
    assert resumed.num_cached_tokens == resumed.num_prompt_tokens  # all 5 prompt tokens came from the cache
    assert sched.num_cached_prompt_tokens == resumed.num_prompt_tokens


@pytest.mark.parametrize("caching", [False, True])
def test_a_prefill_preempted_after_sending_blocks_resumes_after_them(caching: bool) -> None:
    """A prefill worker pins the blocks a KV send reads until the transfer is over. A request
    preempted after sending some freed its own references and came back to compute its whole
    prompt into new blocks beside its pinned ones: on a small pool (pinned + prompt > pool, no
    prefix cache to find them by) it never fit, preempted itself step after step, and the decode
    worker waited for its prefill timeout (tests/cluster/test_disagg_differential.py, seed 551).
    It now keeps the blocks others hold too and resumes after them."""
    from test_scheduler import check_blocks

    from pdserve.workers.kv.cache_manager import KVCacheManager
    from pdserve.workers.scheduler import SchedulerConfig

    sched = Scheduler(SchedulerConfig(4, 2 * BS), KVCacheManager(8, BS, enable_prefix_caching=caching))
    req = make_request("p", 7 * BS, max_tokens=1)
    sched.add(req)
    for _ in range(2):  # two chunks: 4 blocks computed
        out = sched.schedule()
        for s in out.scheduled:
            sched.advance(s)
    pinned = sched.kv.blocks_of("p")[:4]
    sched.kv.pool.touch(pinned)  # the sends of its first 4 blocks
    sched._preempt(sched.running.pop())  # another request's need took its blocks
    assert req.num_computed_tokens == 4 * BS and sched.kv.blocks_of("p") == pinned
    for _ in range(20):
        if req.finished:
            break
        step_out = sched.schedule()
        assert step_out.scheduled, "the preempted prefill can never run again"
        for s in step_out.scheduled:
            sched.advance(s)
            if s.samples:
                req.append_token(1)
                sched.took_token(req, FinishReason.LENGTH)
        check_blocks(sched, pinned)
    assert req.finish_reason is FinishReason.LENGTH
    sched.kv.pool.free(reversed(pinned))  # its transfer over
    assert all_blocks_free(sched)


def test_requests_that_share_prompts_and_are_preempted_do_not_pin_the_pool_between_them() -> None:
    """Two pairs of requests, each pair one prompt (the prefix cache shares it), on a pool that
    holds one request whole but not two. Preempted requests used to keep the blocks they shared
    with their twin; once both twins of each pair waited, the two prompts pinned most of the pool
    and the request at the head never fit beside them: no request ever finished (a helper's
    offline repro, 40 blocks of 16: 5,000 steps, 0 finished). Blocks only requests share are
    freed on preemption now (the cache finds them again); each request finishes."""
    sched = make_scheduler(num_blocks=40, max_num_seqs=8, budget=64)
    a, b = 20 * BS, 15 * BS
    reqs = [make_request(rid, n, max_tokens=19 * BS - 4, first_token=first)
            for rid, n, first in (("a1", a, 0), ("b1", b, 5000), ("a2", a, 0), ("b2", b, 5000))]
    for req in reqs:
        sched.add(req)
    outs = run_to_completion(sched, max_steps=3000)
    assert any(o.preempted for o in outs)  # the case: preemption on a shared prompt
    assert [r.finish_reason for r in reqs] == [FinishReason.LENGTH] * 4
    assert all_blocks_free(sched)
