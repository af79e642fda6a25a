"""The scheduler at its boundaries: FCFS and starvation, tiny pools and budgets, the prefix
cache under pressure. A real KVCacheManager and the fake model of test_scheduler.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from factories import tiny_spec
from test_memory_plan import FakeProbe, MiB
from test_scheduler import BS, S, all_blocks_free, make_request, make_scheduler, step

from pdserve import LLM
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
