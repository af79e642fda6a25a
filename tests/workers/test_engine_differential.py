"""Differential fuzz of the offline engine: a greedy request's output (token ids, text, finish and
stop reasons, logprobs) is the same alone on a plain engine and in a batch of other random requests
under speculative decoding (n-gram, draft model), prefix caching with shared prefixes, chunked
prefill, a pool small enough to preempt, async scheduling, and their combinations. A seeded random
request's samples are the same too (they depend only on the seed; seeded requests do not draft).

A fixed number of seeded cases runs in the suite; `PDSERVE_FUZZ_CASES=N` (and `PDSERVE_FUZZ_SEED`)
runs more by hand to hunt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec
from spec_decode_helpers import target_dir

from pdserve import LLM, SamplingParams
from pdserve.workers.sampling_params import sample_seed
from pdserve.workers.tiny.builder import TinyModelSpec

MAX_MODEL_LEN = 192
DRAFT = tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.05, seed=7)
CASES = int(os.environ.get("PDSERVE_FUZZ_CASES", "1"))
FIRST_SEED = int(os.environ.get("PDSERVE_FUZZ_SEED", "0"))
# Text with characters of 1 to 4 UTF-8 bytes: stop strings and prompts that split inside a character.
WORDS = ["the", " cat", " sat", " on", " mat", "é", "ü", " naïve", "日本", "語", "🙂", "—", " ok", ".", "\n", "ß"]
SEEDED = float(os.environ.get("PDSERVE_FUZZ_SEEDED", "0.2"))  # the share of seeded random requests
# Drafts are made at any batch size and price: verification is what is under test.
EAGER_SPEC: dict[str, object] = {"spec_max_batch_size": 256, "spec_token_cost": 0.001}


def configs(draft: Path, target: Path) -> dict[str, dict[str, object]]:
    """Engine settings that must not change a greedy output (each beside the plain oracle's). The
    target as its own draft has its drafts accepted; the other draft model has them rejected."""
    return {
        "ngram": {"speculative": "ngram", "num_speculative_tokens": 3, **EAGER_SPEC},
        "draft": {"speculative": "draft", "draft_model": str(draft), "num_speculative_tokens": 2, **EAGER_SPEC},
        "prefix": {"enable_prefix_caching": True},
        "chunked": {"max_num_batched_tokens": 24, "max_num_seqs": 3, "block_size": 16},
        "preempt": {"num_kv_blocks": 26, "enable_prefix_caching": True},
        "async": {"async_scheduling": True},
        "async+chunked+preempt": {"async_scheduling": True, "max_num_batched_tokens": 40, "num_kv_blocks": 26},
        "ngram+prefix+chunked": {"speculative": "ngram", "num_speculative_tokens": 4, "enable_prefix_caching": True,
                                 "max_num_batched_tokens": 32, **EAGER_SPEC},
        "draft+preempt+chunked": {"speculative": "draft", "draft_model": str(draft), "num_speculative_tokens": 3,
                                  "num_kv_blocks": 26, "max_num_batched_tokens": 48, **EAGER_SPEC},
        "ngram+async+preempt": {"speculative": "ngram", "num_speculative_tokens": 2, "async_scheduling": True,
                                "num_kv_blocks": 52, "block_size": 4, **EAGER_SPEC},
        "self-draft+prefix+preempt": {"speculative": "draft", "draft_model": str(target), "num_speculative_tokens": 4,
                                      "num_kv_blocks": 26, "enable_prefix_caching": True, **EAGER_SPEC},
    }


def make_llm(model_dir: Path, **kw: object) -> LLM:
    args: dict[str, object] = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=512, enable_prefix_caching=False,
                                   max_num_batched_tokens=4096, block_size=8, progress=False)
    args.update(kw)
    return LLM(str(model_dir), **args)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return target_dir(make_model)


@pytest.fixture(scope="module")
def draft_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(DRAFT)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> LLM:
    return make_llm(model_dir)


# -- random requests -------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    prompt: str | list[int]
    params: SamplingParams


def random_prompt(rng: random.Random, prefixes: list[list[int]], tok: Any) -> str | list[int]:
    """Text (multi-byte characters), random ids, a repetitive motif (n-gram drafts hit), or one of a
    few shared prefixes and a random tail (prefix caching hits), within a short context."""
    kind = rng.randrange(5)
    if kind == 0:
        text = "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40)))
        return text if tok.encode(text) else "the"
    if kind == 1:
        return [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 60))]
    if kind == 2:
        motif = [rng.randrange(5, 4000) for _ in range(rng.randrange(2, 8))]
        return (motif * 30)[: rng.randrange(len(motif), 90)]
    return rng.choice(prefixes) + [rng.randrange(5, 4000) for _ in range(rng.choice([0, rng.randrange(0, 20)]))]


def random_params(rng: random.Random, prompt: list[int], probe: list[int], probe_text: str,
                  prompt_text: str, eos: int) -> SamplingParams:
    """Random greedy parameters, their stops drawn from the request's own plain output (`probe`,
    `probe_text`) and prompt, so that some of them hit."""
    room = MAX_MODEL_LEN - len(prompt)
    max_tokens = rng.choice([1, 2, rng.randrange(1, 12), rng.randrange(1, 12), rng.randrange(1, 40),
                             rng.randrange(1, 40), room, None])
    limit = room if max_tokens is None else max_tokens
    stop: list[str] = []
    for _ in range(rng.choice([0, 0, 1, 2, 3])):
        source = rng.choice([probe_text, probe_text, prompt_text, "".join(WORDS)])
        if source:
            i = rng.randrange(len(source))
            stop.append(source[i:i + rng.randrange(1, 6)])
    stop_ids = rng.sample(probe, min(len(probe), rng.choice([0, 0, 1, 2]))) if probe else []
    penalties: dict[str, float] = {}
    if rng.random() < 0.25:
        penalties = {"repetition_penalty": rng.choice([0.8, 1.3, 2.0]),
                     "frequency_penalty": rng.choice([0.0, 0.5, -0.5]),
                     "presence_penalty": rng.choice([0.0, 1.0, -1.0])}
    bias = ({t: rng.choice([-100.0, -2.0, 3.0, 100.0]) for t in rng.sample(probe or [7], 1)}
            if rng.random() < 0.15 else {})
    if rng.random() < 0.25:  # EOS made likely: it ends requests (min_tokens and ignore_eos permitting)
        bias[eos] = rng.choice([3.0, 6.0, 10.0])
    # Now and then a seeded random request: its samples depend only on its seed (docs/engine.md).
    sampled = ({"temperature": rng.choice([0.6, 1.0, 1.5]), "seed": rng.randrange(-5, 2**40),
                "top_k": rng.choice([0, 5, 50]), "top_p": rng.choice([1.0, 0.9]), "min_p": rng.choice([0.0, 0.05])}
               if rng.random() < SEEDED else {"temperature": 0.0})
    # Now and then vLLM's vocabulary restrictions: tokens of the plain output and a few others
    # allowed, or a piece of the plain output's text as a bad word.
    restrict: dict[str, object] = {}
    draw = rng.random()
    if draw < 0.1 and probe:
        restrict["allowed_token_ids"] = sorted(set(rng.sample(probe, min(3, len(probe)))
                                                   + [rng.randrange(5, 4000) for _ in range(3)]))
    elif draw < 0.2 and probe_text.strip():
        i = rng.randrange(len(probe_text))
        if (word := probe_text[i:i + rng.randrange(1, 6)]).strip():
            restrict["bad_words"] = [word]
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]), **sampled, **restrict, max_tokens=max_tokens,  # type: ignore[arg-type]
        min_tokens=rng.choice([0, 0, rng.randrange(0, limit + 1)]), stop=stop, stop_token_ids=stop_ids,
        ignore_eos=rng.random() < 0.5, include_stop_str_in_output=rng.random() < 0.3,
        logprobs=rng.choice([None, None, 0, 1, 3]), prompt_logprobs=rng.choice([None, None, None, 0, 2]),
        skip_special_tokens=rng.random() < 0.9, logit_bias=bias or None,
        detokenize=bool(stop) or rng.random() < 0.9, **penalties)


def random_cases(rng: random.Random, oracle: LLM, n: int) -> list[Case]:
    tok = oracle.tokenizer
    # Shared by every case of a run (drawn from a fixed seed), so later batches hit earlier ones' blocks.
    shared = random.Random(0)
    prefixes = [[shared.randrange(5, 4000) for _ in range(shared.randrange(8, 50))] for _ in range(3)]
    prompts = [random_prompt(rng, prefixes, tok) for _ in range(n)]
    probe_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    probes = oracle.generate(prompts, probe_params)
    cases = []
    for prompt, probe in zip(prompts, probes):
        ids = probe.prompt_token_ids
        text = prompt if isinstance(prompt, str) else tok.decode(ids)
        params = random_params(rng, ids, probe.outputs[0].token_ids, probe.outputs[0].text, text, tok.eos_token_id)
        cases.append(Case(prompt if rng.random() < 0.8 or isinstance(prompt, list) else {"prompt": prompt}, params))
    return cases


# -- comparison ------------------------------------------------------------------------------------


def _entries_close(got: dict[int, Any] | None, want: dict[int, Any] | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is None or want is None:
        return
    # Keys may differ only between tokens whose log-probs tie; the values of shared keys agree.
    assert len(got) == len(want), what
    for t in got.keys() & want.keys():
        assert math.isclose(float(got[t]), float(want[t]), rel_tol=1e-4, abs_tol=1e-4), f"{what}: token {t}"
    for t in got.keys() ^ want.keys():
        lp = float(got.get(t, want.get(t)))
        others = [float(v) for v in (want if t in got else got).values()]
        assert any(math.isclose(lp, o, abs_tol=1e-4) for o in others), f"{what}: token {t} only on one side"


def assert_same(got: Any, wants: list[Any], label: str) -> None:
    """`got` (n samples) against each sample run alone (`wants`)."""
    want = wants[0]
    assert len(got.outputs) == len(wants), label
    assert got.prompt_token_ids == want.prompt_token_ids, label
    for j, g in enumerate(got.outputs):
        w = wants[j].outputs[0]
        where = f"{label} sample {j}"
        assert g.token_ids == w.token_ids, where
        assert g.text == w.text, where
        assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), where
        assert (g.logprobs is None) == (w.logprobs is None), where
        if g.logprobs is not None:
            assert len(g.logprobs) == len(w.logprobs), where
            for i, (a, b) in enumerate(zip(g.logprobs, w.logprobs)):
                _entries_close(a, b, f"{where} logprobs[{i}]")
            assert math.isclose(g.cumulative_logprob, w.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-3), where
    assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None), label
    if want.prompt_logprobs is not None:
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs), label
        for i, (a, b) in enumerate(zip(got.prompt_logprobs, want.prompt_logprobs)):
            _entries_close(a, b, f"{label} prompt_logprobs[{i}]")


def check(oracle: LLM, llm: LLM, cases: list[Case], label: str) -> None:
    alone = [[oracle.generate([c.prompt], dataclasses.replace(c.params, n=1, seed=sample_seed(c.params.seed, j)))[0]
              for j in range(c.params.n if c.params.seed is not None else 1)] for c in cases]
    batched = llm.generate([c.prompt for c in cases], [c.params for c in cases])
    for i, (c, got, wants) in enumerate(zip(cases, batched, alone)):
        assert_same(got, wants * (c.params.n if c.params.seed is None else 1),
                    f"{label} request {i} {c.prompt!r:.60} {c.params}")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_used == 0, f"{label}: blocks left allocated"


# The suite runs the combinations (each setting is in one); a hunt (PDSERVE_FUZZ_CASES) runs all.
COMBINED = ["async+chunked+preempt", "ngram+prefix+chunked", "draft+preempt+chunked", "ngram+async+preempt",
            "self-draft+prefix+preempt"]
SINGLE = ["ngram", "draft", "prefix", "chunked", "preempt", "async"]


@pytest.mark.parametrize("config", COMBINED + (SINGLE if "PDSERVE_FUZZ_CASES" in os.environ else []))
def test_greedy_outputs_match_the_plain_engine_alone(model_dir: Path, draft_dir: Path, oracle: LLM,
                                                    config: str) -> None:
    llm = make_llm(model_dir, **configs(draft_dir, model_dir)[config])
    for case in range(CASES):
        seed = FIRST_SEED + case
        rng = random.Random(f"{config}/{seed}")
        check(oracle, llm, random_cases(rng, oracle, rng.randrange(2, 7)), f"{config} seed {seed}")
