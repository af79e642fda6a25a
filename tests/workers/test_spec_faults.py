"""Speculative decoding when a model's logits break: as without drafts, or at the cost of drafts.

1. A greedy verification took the target's argmax without `sampler.checked`: a row whose
   logits have no finite choice (NaN) emitted token 0 (and went on to `length`), where the
   same request without speculation is failed alone with an error.
2. A draft model whose logits have no finite choice gave NO_TOKEN (-1) as a draft; the
   draft's next pass embedded -1 and raised inside `Speculator.propose`, outside the row-fault
   isolation: the whole engine step raised, every request was lost. Drafts are a hint: a
   broken draft must cost drafts, not the target's output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from spec_decode_helpers import FixedDrafts, prompts, target_dir

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return target_dir(make_model)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_nan_logits_in_a_greedy_verification_fail_the_request_as_without_speculation(
        model_dir: Path, speculative: bool) -> None:
    """The target starts making NaN logits (in a verify step when speculating): without
    speculation the request is failed alone (finish 'abort', an error); with it, the same."""
    extra = dict(speculative="ngram", num_speculative_tokens=3, spec_token_cost=0.01) if speculative else {}
    llm = LLM(str(model_dir), max_model_len=256, progress=False, **extra)
    if speculative:
        llm.engine.spec.proposer = FixedDrafts([7, 8, 9])  # type: ignore[union-attr,assignment]
    model = llm.engine.model
    real = model.compute_logits
    calls = {"n": 0}

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        out = real(hidden)
        if calls["n"] > 3 and (not speculative or hidden.shape[0] > 1):  # NaN from the 4th (verify) step on
            out.fill_(float("nan"))
        return out

    model.compute_logits = broken  # type: ignore[method-assign]
    out = llm.generate([prompts()[1]], GREEDY)[0]
    if speculative:
        assert llm.engine.stats.spec_drafts > 0
    assert out.outputs[0].finish_reason == "abort", (out.outputs[0].finish_reason, out.outputs[0].token_ids)
    assert out.error is not None


def test_a_draft_model_that_makes_nan_costs_drafts_not_the_targets_output(model_dir: Path) -> None:
    ps = prompts(2)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), max_model_len=256, progress=False).generate(ps, GREEDY)]
    spec = LLM(str(model_dir), max_model_len=256, progress=False, speculative="draft", draft_model=str(model_dir),
               num_speculative_tokens=3, spec_token_cost=0.01)
    draft = spec.engine.spec.proposer.model  # type: ignore[union-attr]
    real = draft.compute_logits
    draft.compute_logits = lambda hidden: real(hidden).fill_(float("nan"))  # e.g. a draft overflowing in fp16
    got = spec.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(o.error is None for o in got)


class _Raises:
    """A proposer that fails every time it is asked (a draft model out of memory, a bug)."""

    def __init__(self) -> None:
        self.calls = 0

    def draft(self, requests: list, ks: list[int]) -> tuple[list[list[int]], list[None]]:
        self.calls += 1
        raise RuntimeError("the proposer broke")

    def retain(self, request_ids: set[str]) -> None:
        pass


def test_a_proposer_that_raises_costs_drafts_not_the_step(model_dir: Path) -> None:
    ps = prompts(2)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), max_model_len=256, progress=False).generate(ps, GREEDY)]
    spec = LLM(str(model_dir), max_model_len=256, progress=False, speculative="ngram", num_speculative_tokens=3,
               spec_token_cost=0.01)
    broken = _Raises()
    spec.engine.spec.proposer = broken  # type: ignore[union-attr,assignment]
    got = spec.generate(ps, GREEDY)
    assert broken.calls > 0
    assert [o.outputs[0].token_ids for o in got] == want and all(o.error is None for o in got)
