"""The scheduler with a real KVCacheManager and a fake model: every scheduled
chunk is "computed" and every sampling chunk yields one token. No tensors."""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.lifecycle import Exit, Lifecycle, RequestState
from pdserve.workers.request import FinishReason, Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4  # block size
S = RequestState


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget), KVCacheManager(num_blocks, BS))


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, first_token: int = 0) -> Request:
    tokens = list(range(first_token, first_token + prompt_len))
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model; checks the invariants every step must keep."""
    out = sched.schedule()
    check_step(sched, out)
    sampling = [s.request for s in out.scheduled if s.samples]  # read before advance moves the counters
    for s in out.scheduled:
        sched.advance(s)
    for req in sampling:
        req.append_token(1000 + req.num_output_tokens)
        sched.took_token(req, FinishReason.LENGTH if req.num_output_tokens >= req.max_tokens else None)
    check_blocks(sched)
    return out


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for s in out.scheduled:
        req = s.request
        assert s.num_tokens > 0
        assert req.life.state in (S.PREFILLING, S.DECODING) and req in sched.running
        assert req.num_computed_tokens + s.num_tokens <= req.num_tokens
        assert len(sched.kv.blocks_of(req.request_id)) * BS >= req.num_computed_tokens + s.num_tokens, "no slots"
    for req in out.preempted:
        assert req.life.state is S.QUEUED and req.life.history[-2] in (S.PREFILLING, S.DECODING)
        # It keeps only a leading run of full blocks that others hold too, and resumes after them.
        kept = sched.kv.blocks_of(req.request_id)
        assert req.num_computed_tokens == len(kept) * BS < req.num_tokens and req in sched.waiting
        assert all(sched.kv.pool.ref_counts[b] > 1 for b in kept)


def check_blocks(sched: Scheduler, pins: Iterable[int] = ()) -> None:
    """Each block's ref count is the number of requests holding it (plus `pins`: references a
    test took itself); waiting ones hold none but those whose KV came from a prefill worker (they
    hold their reserved blocks, as do those whose KV is still on its way) and preempted ones
    that kept the blocks others held too."""
    holding = [*sched.running, *sched.awaiting_kv.values(), *sched.waiting]
    holders = Counter(b for req in holding for b in sched.kv.blocks_of(req.request_id)) + Counter(pins)
    pool = sched.kv.pool
    assert all(pool.ref_counts[b] == holders.get(b, 0) for b in range(pool.num_blocks))


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def all_blocks_free(sched: Scheduler) -> bool:
    pool = sched.kv.pool
    return pool.num_free == pool.num_blocks and not any(pool.ref_counts)


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_tokens for s in out.scheduled}


# -- budget and chunked prefill ------------------------------------------------------


def test_long_prompt_is_chunked_beside_running_decodes() -> None:
    sched = make_scheduler(budget=16)
    decoders = [make_request(f"d{i}", 5, max_tokens=20, first_token=100 * (i + 1)) for i in range(2)]
    for r in decoders:
        sched.add(r)
    assert scheduled_tokens(step(sched)) == {"d0": 5, "d1": 5}

    long = make_request("long", 40, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(sched)
        got = scheduled_tokens(out)
        assert got["d0"] == got["d1"] == 1, "decodes run in the same step as the prefill chunk"
        chunks.append(got["long"])
    assert chunks == [14, 14, 12]
    assert long.num_computed_tokens == 40 and long.num_output_tokens == 1


def test_only_the_last_prefill_chunk_samples() -> None:
    sched = make_scheduler(budget=8)
    req = make_request("a", 20, max_tokens=3)
    sched.add(req)
    samples = []
    while sched.has_unfinished():
        out = sched.schedule()
        [s] = out.scheduled
        samples.append((s.num_tokens, s.samples))
        sched.advance(s)
        if samples[-1][1]:
            req.append_token(7)
            if req.num_output_tokens == 3:
                sched.finish(req, FinishReason.LENGTH)
    assert samples == [(8, False), (8, False), (4, True), (1, True), (1, True)]
    assert all_blocks_free(sched)


def test_token_budget_holds_under_load() -> None:
    sched = make_scheduler(num_blocks=128, max_num_seqs=6, budget=24)
    for i in range(12):
        sched.add(make_request(str(i), 3 + 7 * i % 29, max_tokens=1 + i % 5, first_token=100 * i))
    outs = run_to_completion(sched)  # step() asserts the budget every step
    assert max(o.num_tokens for o in outs) == 24
    assert all_blocks_free(sched)


# -- admission -----------------------------------------------------------------------


def test_max_num_seqs_caps_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=100)
    reqs = [make_request(str(i), 4, max_tokens=3, first_token=100 * i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    max_running = 0
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out = step(sched)
        assert len(out.scheduled) <= 2
        max_running = max(max_running, len(sched.running))
    assert max_running == 2
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3 for r in reqs)


def test_admission_is_first_come_first_served() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=100)
    reqs = [make_request(str(i), 2 + (7 * i) % 5, max_tokens=1 + i % 3, first_token=100 * i) for i in range(8)]
    for r in reqs:
        sched.add(r)
    admitted: list[str] = []
    while sched.has_unfinished():
        for s in step(sched).scheduled:
            if s.request.request_id not in admitted:
                admitted.append(s.request.request_id)
    assert admitted == [r.request_id for r in reqs]


def test_a_blocked_head_of_queue_is_not_overtaken() -> None:
    sched = make_scheduler(num_blocks=6, budget=100)
    hog = make_request("hog", 16, max_tokens=2)  # 4 blocks, then a 5th for its first decode
    sched.add(hog)
    step(sched)
    big = make_request("big", 12, first_token=100)  # 3 blocks: does not fit yet
    small = make_request("small", 3, first_token=200)  # 1 block: would fit
    sched.add(big)
    sched.add(small)
    assert scheduled_tokens(step(sched)) == {"hog": 1}
    assert list(sched.waiting) == [big, small]
    run_to_completion(sched)
    assert big.num_output_tokens == small.num_output_tokens == 4


# -- preemption ----------------------------------------------------------------------


def test_preempts_the_newest_running_request_and_resumes_it() -> None:
    # 6 blocks of 4: three 7-token prompts take 2 blocks each; the third decode
    # steps want a 3rd block per request, and only the newest gives way.
    sched = make_scheduler(num_blocks=6, budget=64)
    reqs = [make_request(f"r{i}", 7, max_tokens=6, first_token=100 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    outs = run_to_completion(sched)

    preempted = [r.request_id for o in outs for r in o.preempted]
    assert preempted and set(preempted) == {"r2"}
    first = next(i for i, o in enumerate(outs) if o.preempted)
    assert outs[first].preempted == [reqs[2]]
    assert "r2" not in scheduled_tokens(outs[first])
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 6 for r in reqs)
    assert reqs[2].output_token_ids == [1000 + i for i in range(6)], "outputs survive the recompute"
    assert all_blocks_free(sched)


def test_preempted_request_goes_to_the_front_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=64)
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 8, max_tokens=8, first_token=100)
    late = make_request("late", 2, max_tokens=1, first_token=200)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 4 blocks
    sched.add(late)
    out = step(sched)  # decodes need 2 more blocks, 1 free: b gives way
    assert out.preempted == [b] and scheduled_tokens(out) == {"a": 1}
    assert list(sched.waiting) == [b, late]
    assert b.num_computed_tokens == 0 and sched.kv.blocks_of("b") == []
    run_to_completion(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8 and late.num_output_tokens == 1
    assert all_blocks_free(sched)


def test_random_workload_loses_no_request() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, max_num_seqs=5, budget=20)
    reqs: list[Request] = []
    aborted: set[str] = set()
    preemptions = 0
    for t in range(400):
        if t < 60 and rng.random() < 0.5:
            # Some prompts share a prefix, so cached blocks get shared and evicted too.
            base = 0 if rng.random() < 0.4 else 1000 * (len(reqs) + 1)
            req = make_request(f"q{len(reqs)}", rng.randint(1, 30), rng.randint(1, 12), first_token=base)
            reqs.append(req)
            sched.add(req)
        if reqs and rng.random() < 0.03:
            victim = rng.choice(reqs)
            if not victim.finished:
                sched.finish(victim, FinishReason.ABORT)
                aborted.add(victim.request_id)
        if sched.has_unfinished():
            preemptions += len(step(sched).preempted)
    assert not sched.has_unfinished() and not sched.requests
    assert preemptions > 0, "the workload should exercise preemption"
    for r in reqs:
        if r.request_id in aborted:
            assert r.finish_reason is FinishReason.ABORT and r.life.exit is Exit.ABORTED
        else:
            assert r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == r.max_tokens
            assert r.life.exit is Exit.FINISHED and r.life.history[-2] is S.DECODING
    assert all_blocks_free(sched)  # cached-evictable blocks count as free


# -- abort ---------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_in_any_state() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1, budget=64)
    running = make_request("running", 10, max_tokens=10)
    waiting = make_request("waiting", 6, first_token=100)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert running.life.state is S.DECODING and waiting.life.state is S.QUEUED
    assert sched.kv.pool.num_free == 8 - 3

    sched.finish(waiting, FinishReason.ABORT)
    assert waiting not in sched.waiting and "waiting" not in sched.requests
    sched.finish(running, FinishReason.ABORT)
    assert sched.kv.blocks_of("running") == [] and all_blocks_free(sched)
    assert not sched.has_unfinished() and not sched.schedule().scheduled
    assert running.finish_reason is FinishReason.ABORT and running.life.state is S.ABORTED

    sched.finish(running, FinishReason.LENGTH)  # finishing twice changes nothing
    assert running.finish_reason is FinishReason.ABORT and running.life.state is S.ABORTED


def test_abort_of_a_preempted_request() -> None:
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=64)
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 8, max_tokens=8, first_token=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert step(sched).preempted == [b]
    sched.finish(b, FinishReason.ABORT)
    assert b not in sched.waiting
    run_to_completion(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 1
    assert all_blocks_free(sched)


def test_a_requests_state_moves_with_its_queue() -> None:
    """A request's one state is its lifecycle, moved by the scheduler as the request
    changes queue: a preempted request is QUEUED again and prefills again; a request
    the engine owns ends when it finishes."""
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=64)
    a, b = make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3, first_token=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.life.state is b.life.state is S.DECODING  # both sampled their first token
    assert step(sched).preempted == [b] and b.life.state is S.QUEUED
    run_to_completion(sched)
    assert a.life.history == [S.QUEUED, S.PREFILLING, S.DECODING, S.FINISHED]
    assert b.life.history == [S.QUEUED, S.PREFILLING, S.DECODING, S.QUEUED, S.PREFILLING, S.DECODING, S.FINISHED]


def test_a_workers_requests_move_through_the_handoff_and_end_with_the_worker() -> None:
    """A worker's lifecycle (its job's) is moved here through the handoff's states, and
    ended by the worker, not here: the output has yet to leave the worker."""
    sched = make_scheduler(budget=64)
    life = Lifecycle("d", 10.0, S.ROUTED)
    landed = Request("d", list(range(10)), SamplingParams(max_tokens=2), max_tokens=2, life=life)
    assert sched.reserve_remote(landed) is not None and life.state is S.TRANSFERRING
    sched.complete_remote(landed)
    landed.append_token(5)
    sched.took_token(landed, None)
    assert life.state is S.DECODING
    step(sched)
    assert landed.finish_reason is FinishReason.LENGTH and not life.ended and "d" not in sched.requests
    assert life.history == [S.ROUTED, S.TRANSFERRING, S.DECODING]

    failed = Request("f", list(range(50, 60)), SamplingParams(max_tokens=1), max_tokens=1,
                     life=Lifecycle("f", 10.0, S.ROUTED))
    sched.reserve_remote(failed)
    sched.prefill_locally(failed)  # its KV did not come: it prefills here
    assert failed.life.history == [S.ROUTED, S.TRANSFERRING, S.QUEUED]

    sched = make_scheduler(budget=64)
    held = Request("p", list(range(100, 110)), SamplingParams(max_tokens=1), max_tokens=1, hold_kv=True,
                   life=Lifecycle("p", 10.0))
    sched.add(held)
    [s] = sched.schedule().scheduled
    sched.advance(s)
    held.append_token(7)
    sched.took_token(held, FinishReason.LENGTH)
    assert held.life.history == [S.QUEUED, S.PREFILLING, S.TRANSFERRING] and sched.kv.blocks_of("p")
    sched.release("p")  # its KV was sent
    assert not sched.kv.blocks_of("p") and held.life.state is S.TRANSFERRING  # its worker ends it


def test_prefix_cache_serves_a_repeated_prompt() -> None:
    sched = make_scheduler(budget=64)
    first = make_request("first", 13, max_tokens=1)
    sched.add(first)
    run_to_completion(sched)
    again = make_request("again", 13, max_tokens=1)
    sched.add(again)
    out = step(sched)
    assert scheduled_tokens(out) == {"again": 1} and again.num_cached_tokens == 12
    assert sched.num_cached_prompt_tokens == 12
    assert all_blocks_free(sched)


def test_only_the_scheduler_moves_a_request_in_a_worker() -> None:
    """The one-writer rule that keeps a worker's two views of a request from drifting apart:
    in workers/, a lifecycle is moved (`move`, `advance`) in scheduler.py only (the gateway's
    collector, cluster/token_collector.py, walks the gateway's own), and nothing assigns its
    `state` or `history` but lifecycle.py itself."""
    root = Path(__file__).resolve().parents[2] / "workers"
    movers, writers = set(), set()
    for path in root.rglob("*.py"):
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("move", "advance") and _names_a_lifecycle(node.func.value):
                movers.add(name)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(isinstance(t, ast.Attribute) and t.attr in ("state", "history") and _names_a_lifecycle(t.value)
                   for t in targets):
                writers.add(name)
    assert movers - {"lifecycle.py"} == {"scheduler.py"}, movers
    assert writers <= {"lifecycle.py"}, writers


def _names_a_lifecycle(node: ast.expr) -> bool:
    """`life`, `x.life`, `self` (inside lifecycle.py): the expressions a lifecycle goes by here."""
    return (isinstance(node, ast.Name) and node.id in ("life", "self")) or \
        (isinstance(node, ast.Attribute) and node.attr == "life")


def test_a_request_whose_kv_landed_is_not_starved_by_a_preempted_one_that_needs_its_blocks() -> None:
    """A decode worker's pool is full: a local request holds most of it and a handed-off one
    holds the rest, its KV landed. The local one needs a block more and preempts itself; it
    goes back to the queue's head, needing more blocks than are free while the handed-off one
    holds its own. The handed-off request (it needs no new block to start) runs first, ends and
    frees its blocks, and then the preempted one runs: both finish, no step stalls for good."""
    sched = make_scheduler(num_blocks=10, max_num_seqs=4, budget=64)
    local = make_request("local", 20, max_tokens=16)  # at most 36 tokens: 9 of the 10 blocks
    sched.add(local)
    while local.num_computed_tokens < 6 * BS:  # its computed tokens fill 6 blocks exactly
        step(sched)
    landed = Request("landed", list(range(500, 500 + 4 * BS - 1)), SamplingParams(max_tokens=2), max_tokens=2,
                     life=Lifecycle("landed", 10.0, S.ROUTED))
    assert sched.reserve_remote(landed) is not None and sched.kv.pool.num_free == 0
    sched.complete_remote(landed)
    landed.append_token(5)
    sched.took_token(landed, None)
    outs = [step(sched) for _ in range(40)]
    assert any(local in o.preempted for o in outs)
    assert landed.finish_reason is FinishReason.LENGTH and local.finish_reason is FinishReason.LENGTH
    assert not sched.waiting and not sched.running
