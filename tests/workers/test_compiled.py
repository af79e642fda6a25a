"""The compiled model (torch.compile, CPU) computes what the eager model does.

The eager model is itself held to transformers (test_model_parity.py); here the
compiled engine must give the same greedy tokens and the same log-probs as an
eager one on every kind of step: prefill, chunked prefill, batched and batch-1
decode, prefix-cache hits, preemption and speculative verification. A
compile failure must leave a working eager engine.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import capture_logits, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.model import compiled, packed_linear
from pdserve.workers.model.compiled import CompiledForward
from pdserve.workers.tiny.builder import TinyModelSpec

# Inductor's CPU code is C++: without a compiler the engine falls back to eager
# (the last tests check that), and there is nothing compiled to compare.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("clang++") is None,
                               reason="no C++ compiler for Inductor")

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


def make_llm(model_dir: Path, eager: bool, **kw: object) -> LLM:
    # Small steps and a small pool: prompts are prefilled in chunks, and eight
    # long requests cannot all hold their blocks at once (preemption).
    args: dict[str, object] = dict(dtype="float32", max_model_len=256, num_kv_blocks=24,
                                   max_num_batched_tokens=64, progress=False, enforce_eager=eager)
    args.update(kw)
    return LLM(str(model_dir), **args)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]


def outputs(llm: LLM, batch: list[list[int]], params: SamplingParams = PARAMS) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params)]


def assert_same(got: list[tuple[list[int], list]], want: list[tuple[list[int], list]]) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        for step, ref_step in zip(lps, ref_lps, strict=True):  # fused kernels round differently, a little
            assert step.keys() == ref_step.keys()
            for tok in step:
                assert step[tok] == pytest.approx(ref_step[tok], abs=1e-4)


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> tuple[LLM, LLM]:
    return make_llm(model_dir, eager=False), make_llm(model_dir, eager=True)


@needs_cxx
def test_the_engine_runs_the_compiled_graph(pair: tuple[LLM, LLM]) -> None:
    fast, slow = pair
    assert isinstance(fast.engine.runner.forward, CompiledForward)
    assert slow.engine.runner.forward is slow.engine.model


@needs_cxx
def test_compiled_matches_eager_on_every_kind_of_step(pair: tuple[LLM, LLM]) -> None:
    fast, slow = pair
    batch = prompts([5, 90, 17, 140, 33, 61, 120, 8])  # chunked prefills, mixed steps, preemption
    one = prompts([70], seed=1)  # batch 1: the one-token graph
    # Everything was compiled at start: a compile now would be on a request's time.
    with torch.compiler.set_stance("fail_on_recompile"):
        got = outputs(fast, batch)
        got_one = outputs(fast, one)
        got_again = outputs(fast, one)  # the prompt's blocks now come from the prefix cache
    assert_same(got, outputs(slow, batch))
    assert fast.engine.stats.preemptions > 0  # the case was exercised
    assert_same(got_one, outputs(slow, one))
    assert_same(got_again, outputs(slow, one))


@needs_cxx
def test_compiled_verifies_drafts_exactly(model_dir: Path) -> None:
    # N-gram drafts on a repetitive prompt: steps of k + 1 query tokens per sequence.
    fast = make_llm(model_dir, eager=False, speculative="ngram", num_speculative_tokens=3)
    slow = make_llm(model_dir, eager=True)
    batch = [[11, 12, 13, 14] * 12, [40, 41, 42] * 9]
    with torch.compiler.set_stance("fail_on_recompile"):
        got = outputs(fast, batch)
    assert fast.engine.stats.spec_drafts > 0
    assert_same(got, outputs(slow, batch))


@needs_cxx
def test_bfloat16_speculation_keeps_the_plain_engines_greedy_tokens(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Compiled, in bfloat16, at batch 1: an n-gram engine (verify steps of k + 1 rows) gives the
    plain engine's (one-row steps) greedy tokens, as it does in float32. Before one-token steps
    shared the many-token graph, its own graph's kernels rounded differently and near ties went
    the other way (this model, `pdserve make-tiny-model`'s: all three prompts differed by the
    60th token)."""
    model_dir = make_model(TinyModelSpec())
    spec = make_llm(model_dir, eager=False, dtype="bfloat16", speculative="ngram", num_speculative_tokens=4)
    plain = make_llm(model_dir, eager=False, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for prompt in ([11, 12, 13, 14, 15] * 10, list(range(100, 160)), [7, 8, 9] * 20 + [40, 41]):
        with torch.compiler.set_stance("fail_on_recompile"):
            got = spec.generate([prompt], params)[0].outputs[0].token_ids
        assert got == plain.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.engine.stats.spec_accepted_tokens > 0


@needs_cxx
@pytest.mark.skipif(not packed_linear.supported(torch.bfloat16, torch.device("cpu")),
                    reason="oneDNN does not run bfloat16 on this CPU")
def test_compiled_bfloat16_with_packed_weights_matches_eager(model_dir: Path) -> None:
    """In bfloat16 the linears are oneDNN-packed (packed_linear.py) and the compiled graph calls
    them through an opaque op: every step's logits agree with the eager engine's (teacher-forced
    on its tokens, up to bfloat16 rounding), and nothing recompiles on a request's time."""
    fast = make_llm(model_dir, eager=False, dtype="bfloat16")
    slow = make_llm(model_dir, eager=True, dtype="bfloat16")
    assert isinstance(fast.engine.model.lm_head, packed_linear.PackedLinear)
    got, want = capture_logits(fast), capture_logits(slow)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in prompts([70, 9], seed=3):
        got.clear()
        want.clear()
        with torch.compiler.set_stance("fail_on_recompile"):
            tokens = fast.generate([prompt], params)[0].outputs[0].token_ids
        # The last compiled step (decoding over KV the compiled steps wrote) saw the context
        # prompt + tokens[:-1]: an eager prefill of that context computes the same logits.
        slow.generate([prompt + tokens[:-1]], SamplingParams(temperature=0.0, max_tokens=1))
        assert len(got) == len(tokens) and len(want) == 1
        rel = float((got[-1][0] - want[0][0]).norm() / want[0][0].norm())
        assert rel < 3e-2, rel


def test_a_compile_failure_leaves_an_eager_engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kw: object) -> float:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled, "warm_up", broken)
    with caplog.at_level(logging.WARNING):
        llm = make_llm(model_dir, eager=False)
    assert llm.engine.runner.forward is llm.engine.model
    assert "running the model eagerly" in caplog.text and "no C++ compiler" in caplog.text
    batch = prompts([30])
    assert_same(outputs(llm, batch), outputs(make_llm(model_dir, eager=True), batch))


def test_a_block_larger_than_the_context_compiles_and_matches_eager(model_dir: Path, pair: tuple[LLM, LLM]) -> None:
    """Blocks of 512 tokens, a context of 256 and steps of up to 2,048: the warm-up ran
    positions past the rotary table's 256 rows, and the compiled kernel's bounds check aborted
    the process (SIGABRT, no Python error; `pdserve serve` fell back to eager). Its positions
    now stay inside the context."""
    llm = make_llm(model_dir, eager=False, block_size=512, num_kv_blocks=4, max_num_batched_tokens=2048)
    assert llm.engine.runner.forward is not llm.engine.model  # compiled, not fallen back to eager
    batch = prompts([7, 200])
    assert_same(outputs(llm, batch), outputs(pair[1], batch))


def test_enforce_eager_must_be_a_bool(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="enforce_eager"):
        make_llm(model_dir, eager="yes")  # type: ignore[arg-type]
