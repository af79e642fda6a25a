"""The scheduler at its boundaries: FCFS and starvation, tiny pools and budgets, the prefix
cache under pressure. A real KVCacheManager and the fake model of test_scheduler.py."""

from __future__ import annotations

from test_scheduler import BS, S, all_blocks_free, make_request, make_scheduler, step

from pdserve.workers.lifecycle import Lifecycle
from pdserve.workers.request import FinishReason, Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.scheduler import Scheduler


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
