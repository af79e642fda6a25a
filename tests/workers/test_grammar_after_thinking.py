"""A grammar that starts after a token (`StructuredOutputs.after_token`): a thinking model's
answer under a reasoning parser, whose grammar (response_format, a required or named tool call)
applies after its thinking, as vLLM's does. The oracle: the same engine without the grammar up
to that token, and the grammar's own check of what follows."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.handoff import Resume
from pdserve.workers.inbox_wire import params_from_wire, params_to_wire
from pdserve.workers.structured_outputs import StructuredOutputs
from pdserve.workers.tiny.builder import TinyModelSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                           "b": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["a", "b"], "additionalProperties": False}
# Repetitive prompts: n-gram drafts are proposed while the grammar waits, and after.
PROMPTS = ["think think think then answer then answer", "one two three one two three one two three"]


@pytest.fixture(scope="module")
def llms(make_model: Callable[[TinyModelSpec], Path]) -> tuple[LLM, LLM]:
    path = str(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05)))
    return (LLM(path, max_model_len=512, progress=False),
            LLM(path, max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=3,
                spec_max_batch_size=256, spec_token_cost=0.001))


def _thinking_end(llm: LLM, prompt: str) -> tuple[list[int], int]:
    """The free greedy answer, and a position k whose token is the first of its kind in it: taken
    as the end of the thinking, its first occurrence is at k."""
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
    k = next((i for i in range(3, len(free)) if free[i] not in free[:i]), None)
    assert k is not None, free
    return free, k


def _params(end: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputs(json=SCHEMA,
                                                                                               after_token=end))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_output_is_free_up_to_the_token_and_held_to_the_grammar_after(llms: tuple[LLM, LLM], prompt: str) -> None:
    plain, spec = llms
    free, k = _thinking_end(plain, prompt)
    out = plain.generate([prompt], _params(free[k]))[0].outputs[0]
    assert out.token_ids[: k + 1] == free[: k + 1]  # no mask while it thinks
    answer = plain.engine.tokenizer.decode(out.token_ids[k + 1 :], skip_special_tokens=True)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(answer), SCHEMA)
    # With n-gram drafts (verified under no mask, then under the grammar's): the same tokens.
    drafted = spec.engine.stats.spec_draft_tokens
    assert spec.generate([prompt], _params(free[k]))[0].outputs[0].token_ids == out.token_ids
    assert spec.engine.stats.spec_draft_tokens > drafted


def test_without_the_token_the_grammar_never_starts(llms: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """(A model that does not think under a reasoning parser: vLLM's grammar waits too.) Its
    steps, with drafts or not, allocate and apply no mask: a thinking answer is thousands of them."""
    import pdserve.workers.grammar as grammar

    masks: list[int] = []
    real = grammar.allocate_bitmask
    monkeypatch.setattr(grammar, "allocate_bitmask", lambda rows, vocab: masks.append(rows) or real(rows, vocab))
    for llm in llms:
        free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
        never = next(t for t in range(5, 4000) if t not in free)
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=(
            StructuredOutputs(json=SCHEMA, after_token=never))))[0].outputs[0]
        assert out.token_ids == free
    assert masks == []


@pytest.mark.parametrize("cut", ["thinking", "answer"])
def test_a_resumed_request_finds_where_its_grammar_started(llms: tuple[LLM, LLM], cut: str) -> None:
    """Migration: the output another worker made (still thinking, or into the answer) is replayed
    into the grammar from after the token; greedy, the same answer as without the move."""
    plain, _ = llms
    free, k = _thinking_end(plain, PROMPTS[1])
    params = _params(free[k])
    whole = plain.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    at = k - 1 if cut == "thinking" else k + 3
    eng, tok = plain.engine, plain.engine.tokenizer
    eng.add_request(f"resumed-{cut}", tok.encode(PROMPTS[1]), params,
                    resume=Resume(tuple(whole[:at]), len(tok.decode(whole[:at])), None))
    rest: list[int] = []
    while eng.has_unfinished_requests():
        rest += [t for out in eng.step() if out.finished for t in out.outputs[0].token_ids]
    assert rest == whole


def test_the_token_travels_to_a_worker_and_clients_cannot_set_it() -> None:
    from pdserve.cluster.protocol import ChatCompletionRequest

    p = SamplingParams(structured_outputs=StructuredOutputs(json_object=True, after_token=0))
    assert params_from_wire(params_to_wire(p)).constraint == p.constraint  # (token 0 too)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "structured_outputs": {"json_object": True, "after_token": 5}})
    with pytest.raises(ValueError, match="after_token"):
        body.constraint()
    with pytest.raises(ValueError, match="after_token"):
        StructuredOutputs(json_object=True, after_token=-1)


class _Completer:
    """Drafts the rest of a fixed text (what a drafter that guesses the answer well does)."""

    def __init__(self, tok: object, text: str) -> None:
        self.tok, self.text = tok, text

    def draft(self, requests: list[object], ks: list[int]) -> tuple[list[list[int]], list[None]]:
        out = []
        for r, k in zip(requests, ks):
            done = self.tok.decode(r.output_token_ids)  # type: ignore[attr-defined]
            rest = self.text[len(done):] if self.text.startswith(done) else ""
            out.append(self.tok.encode(rest, add_special_tokens=False)[:k] if rest else [])  # type: ignore[attr-defined]
        return out, [None] * len(ks)

    def retain(self, request_ids: set[str]) -> None:
        pass


def test_min_tokens_under_a_grammar_ends_alike_with_drafts(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """min_tokens bans the stop tokens unless the grammar allows nothing else (its end ends the
    request). A verification decided that at its row's first position for all of them: drafts
    that completed the grammar left a later position nothing, and the request failed (a 400)
    where plain decoding ends it with "stop". Found reviewing grammars that start after a token."""
    path = str(make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05)))
    plain = LLM(path, max_model_len=256, progress=False)
    text = " the quick brown"
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12,
                            structured_outputs=StructuredOutputs(choice=[text]))
    prompt = "record 3: the quick brown fox the quick brown fox"
    want = plain.generate([prompt], params)[0]
    assert want.outputs[0].finish_reason == "stop" and want.outputs[0].text == text
    spec = LLM(path, max_model_len=256, progress=False, speculative="ngram", num_speculative_tokens=4,
               spec_max_batch_size=256, spec_token_cost=0.001)
    spec.engine.spec.proposer = _Completer(spec.engine.tokenizer, text)  # type: ignore[union-attr, assignment]
    got = spec.generate([prompt], params)[0]
    assert getattr(got, "error", None) is None
    assert (got.outputs[0].token_ids, got.outputs[0].finish_reason) == (want.outputs[0].token_ids, "stop")
