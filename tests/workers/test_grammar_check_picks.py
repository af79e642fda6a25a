"""On a CPU a greedy constrained row is not masked ahead: its grammar checks the model's pick
and masks only a row whose pick it refuses (model_runner `_fill_masks`, sampler
`_check_picks`). It must give exactly the tokens masking ahead gives (what the GPU path does),
and a pick accepted for a step whose token is never appended must not move the grammar."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.bench.schemas import schemas as random_schemas
from pdserve.workers.grammar import GrammarState, allocate_bitmask, apply_bitmask
from pdserve.workers.sampler import SamplingBatch, sample
from pdserve.workers.structured_outputs import StructuredOutputs
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def llm(make_model: Callable[[TinyModelSpec], Path]) -> LLM:
    path = make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))
    return LLM(str(path), max_model_len=1024, max_num_seqs=32, progress=False)


@pytest.fixture
def takes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Every `GrammarState.take` answer, in order."""
    seen: list[bool] = []
    real = GrammarState.take

    def take(self: GrammarState, token: int) -> bool:
        seen.append(real(self, token))
        return seen[-1]

    monkeypatch.setattr(GrammarState, "take", take)
    yield seen


def _run(llm: LLM, check: bool, prompts: list[str], params: list[SamplingParams]) -> list[tuple[list[int], str]]:
    llm.engine.runner.check_picks = check
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)]
    finally:
        llm.engine.runner.check_picks = True


def test_checking_the_pick_gives_the_tokens_masking_ahead_gives(llm: LLM, takes: list[bool]) -> None:
    """40 schemas, a choice, a regex and an EBNF grammar, greedy, batched with sampled
    constrained rows and a plain one: token for token the same either way. The random
    model's picks are refused often, so both branches run (counted)."""
    schemas = random_schemas(7, 40)
    specs: list[dict[str, Any]] = [{"json": s} for s in schemas] + [
        {"choice": ["alpha", "beta", "gamma delta"]}, {"regex": r"[a-f]{2,5}-[0-9]{3}"},
        {"grammar": 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'}]
    params = [SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=s) for s in specs]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs={"json": schemas[i]})
               for i in range(4)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    prompts = [f"record {i}:" for i in range(len(params))]
    ahead = _run(llm, False, prompts, params)
    assert not takes  # masked ahead: no pick checked
    checked = _run(llm, True, prompts, params)
    assert checked == ahead
    assert takes.count(True) > 100 and takes.count(False) > 20, (takes.count(True), takes.count(False))
    for s, (_, text) in zip(schemas, checked):
        jsonschema.validate(json.loads(text), s)


class AllowSet:
    """A grammar that allows a fixed set of tokens, for the sampler alone."""

    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.allowed = set(allowed)
        bits = np.zeros(allocate_bitmask(1, vocab).shape[1] * 32, dtype=bool)
        bits[allowed] = True
        self.row = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        self.taken: list[int] = []

    def take(self, token: int) -> bool:
        if token in self.allowed:
            self.taken.append(token)
            return True
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.row


def test_a_checked_pick_is_the_masked_argmax_with_ties_and_nans() -> None:
    """Against the oracle (mask, then argmax) on rows built to trip it: ties across the
    allowed and refused sets, NaNs, a refused maximum, rows where nothing allowed is finite."""
    vocab, rows = 100, 64
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (rows, vocab), generator=gen).float()  # many ties
    logits[5, 10] = float("nan")
    logits[6, :] = float("nan")
    logits[7, :] = float("-inf")
    grammars = []
    for r in range(rows):
        allowed = torch.randperm(vocab, generator=gen)[: 1 + r % 30].tolist()
        grammars.append(AllowSet(allowed, vocab))
    grammars[5] = AllowSet([10, 11, 12], vocab)
    oracle_mask = torch.stack([g.row for g in grammars])
    want_logits = logits.clone()
    apply_bitmask(want_logits, oracle_mask)
    want = sample(want_logits, SamplingBatch(temperature=torch.zeros(rows), all_greedy=True)).token_ids
    batch = SamplingBatch(temperature=torch.zeros(rows), all_greedy=True,
                          check_first=[(r, g) for r, g in enumerate(grammars)])  # type: ignore[misc]
    got = sample(logits.clone(), batch).token_ids
    assert got.tolist() == want.tolist()
    assert want[7] == -1  # nothing allowed is finite: the row is refused, not given a token
    assert all(g.taken[-1] == t for g, t in zip(grammars, got.tolist()) if t >= 0 and g.taken)


def test_a_pick_taken_for_a_step_never_appended_does_not_move_the_grammar(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler()
    vocab = llm.engine.runner.vocab_size

    def fresh() -> GrammarState:
        state = compiler.state(StructuredOutputs(choice=["ab cd", "xy z"]))
        state.wait(10)
        assert state.ready([])
        return state

    def mask_of(state: GrammarState) -> list[int]:
        m = allocate_bitmask(1, vocab)
        state.fill(m, 0)
        return m[0].tolist()

    state = fresh()
    start = mask_of(state)
    token = next(t for t in range(vocab) if (start[t >> 5] >> (t & 31)) & 1)
    assert state.take(token)
    assert mask_of(state) == start  # the step was dropped: the grammar is where the output leaves it
    assert state.take(token)
    state.accept(token)  # appended: taken once, not accepted twice
    moved = fresh()
    moved.accept(token)
    assert mask_of(state) == mask_of(moved) != start


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 0.3}, {"min_p": 0.9}])
def test_a_greedy_grammar_row_beside_a_sampled_one_ignores_its_top_k_top_p_min_p(llm: LLM,
                                                                                  cut: dict[str, Any]) -> None:
    """Greedy takes the argmax (vLLM resets top_k, top_p and min_p for it). Batched with a
    sampled request, a greedy row with a grammar and a top_k/top_p cut was cut before its
    grammar's check masked it, and a cut that left no allowed token failed the request."""
    so = {"regex": "[0-9]{3}-[0-9]{3}"}
    greedy = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so, **cut)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["hello world, my number is"], [SamplingParams(temperature=0.0, max_tokens=20,
                                                                          structured_outputs=so)])[0].outputs[0]
    both = llm.generate(["hello world, my number is", "the cat sat on"], [greedy, sampled])
    got = both[0].outputs[0]
    assert (got.text, got.finish_reason) == (alone.text, "stop")
    assert len(both[1].outputs[0].token_ids) == 20
