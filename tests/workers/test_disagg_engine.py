"""Prefill on one engine, KV handed over block by block, decode on another:
the output must equal one engine doing both (the colocated baseline)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.engine import LLMEngine
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


def engine(model_dir: Path, blocks: int = 128) -> LLMEngine:
    return LLM(str(model_dir), max_model_len=512, num_kv_blocks=blocks, progress=False).engine


def run(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def handoff(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """What the workers do, minus the transport: P prefills and samples token 1,
    D reserves blocks, the KV of the blocks D lacks is copied, D decodes."""
    plan = decode.reserve(rid, prompt, params)
    assert plan is not None
    dst_blocks, cached_here = plan
    p_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(rid, prompt, p_params, hold_kv=True)
    first = run(prefill)[rid][0]
    src_blocks = prefill.blocks_of(rid)
    skip = cached_here // prefill.config.block_size
    for (pk, pv), (dk, dv) in zip(prefill.kv_caches, decode.kv_caches):
        idx_src = torch.tensor(src_blocks[skip:])
        idx_dst = torch.tensor(dst_blocks[skip: len(src_blocks)])
        dk[idx_dst] = pk[idx_src]
        dv[idx_dst] = pv[idx_src]
    prefill.release(rid)
    assert prefill.kv.pool.num_used == 0
    decode.complete_reservation(rid, first)
    return run_with_first(decode, rid, first)


def run_with_first(decode: LLMEngine, rid: str, first: int) -> list[int]:
    tokens = run(decode).get(rid)
    assert tokens is not None and tokens[0] == first
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=20, ignore_eos=True),
        # The prefill side's first token sees the prompt's repetition penalty; the
        # decode side counts that first token as generated.
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5,
                       frequency_penalty=0.7, presence_penalty=0.3, logit_bias={9: 2.0}),
        # The prefill side samples the first token under the grammar; the decode side's matcher
        # replays it (never accepts it twice) and goes on: the same tokens as one engine.
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs={"json": {
            "type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                             "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            "required": ["a", "b"], "additionalProperties": False}}),
        SamplingParams(temperature=0.9, seed=5, max_tokens=80, structured_outputs={"regex": r"[a-z]{2,6}-[0-9]{1,3}"}),
    ],
    ids=["greedy", "seeded", "penalties", "json-schema", "regex-seeded"],
)
def test_handoff_equals_colocated(model_dir: Path, params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 4000, (83,), generator=g).tolist()
    colocated = engine(model_dir)
    colocated.add_request("x", prompt, params)
    expected = run(colocated)["x"]
    prefill, decode = engine(model_dir), engine(model_dir)
    assert handoff(prefill, decode, "x", prompt, params) == expected
    assert decode.kv.pool.num_used == 0


def test_decode_worker_prefix_cache_skips_the_shared_blocks(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(5, 4000, (64,), generator=g).tolist()
    prefill, decode = engine(model_dir), engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    handoff(prefill, decode, "a", shared + [11, 12, 13], params)
    plan = decode.reserve("b", shared + [21, 22, 23, 24], params)
    assert plan is not None and plan[1] == 64  # four full blocks already here: only the rest is sent
    decode.abort("b")
    assert decode.kv.pool.num_used == 0


def test_reserve_fails_cleanly_when_the_pool_is_short(model_dir: Path) -> None:
    decode = engine(model_dir, blocks=34)  # max_model_len 512 needs 32
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert decode.reserve("a", list(range(5, 400)), params) is not None
    assert decode.reserve("b", list(range(5, 200)), params) is None
    assert "b" not in decode.scheduler.requests
    decode.abort("a")
    assert decode.kv.pool.num_used == 0 and not decode.has_unfinished_requests()


def test_a_reservation_whose_request_cannot_move_takes_no_blocks(model_dir: Path) -> None:
    """The move to TRANSFERRING came after the blocks were taken: a reservation it refused left
    them held by no request (an abort found nothing to free)."""
    from pdserve.workers.lifecycle import Lifecycle, LifecycleError, RequestState

    decode = engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(LifecycleError):
        decode.reserve("x", list(range(5, 80)), params, Lifecycle("x", 60.0, RequestState.DECODING))
    assert decode.kv.pool.num_used == 0
    assert decode.reserve("x", list(range(5, 80)), params) is not None  # the id is free to use
    decode.abort("x")
    assert decode.kv.pool.num_used == 0


def test_abort_frees_held_prefill_blocks(model_dir: Path) -> None:
    prefill = engine(model_dir)
    prefill.add_request("p", list(range(5, 60)), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    run(prefill)
    assert prefill.blocks_of("p") and prefill.kv.pool.num_used > 0
    prefill.abort("p")
    assert prefill.kv.pool.num_used == 0 and prefill.blocks_of("p") == []
