"""prompt_logprobs: the log-probability of every prompt token given the ones
before it, against transformers' teacher-forced forward (the oracle), through
chunked prefill, a warm prefix cache, preemption and streaming deltas."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers.sampling_params import RequestOutputKind
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(init_std=0.05)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0].log_softmax(-1)  # row i predicts token i + 1

    return logprobs


def _llm(model_dir: Path, **kw: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, progress=False)
    args.update(kw)
    return LLM(str(model_dir), **args)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]


def _check(prompt: list[int], entries: list, ref: torch.Tensor, top_n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        entry = entries[i]
        assert abs(entry[prompt[i]] - row[prompt[i]].item()) < 1e-4, f"token {i}"
        top = row.topk(top_n).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= top_n + 1
        for t in top:
            assert abs(entry[t] - row[t].item()) < 1e-4


@pytest.mark.parametrize("score_rows", [256, 7])
def test_prompt_logprobs_equal_transformers_through_chunked_prefill(model_dir: Path, oracle, score_rows: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with the logits of the scored positions computed a few rows at a time."""
    import pdserve.workers.model_runner as runner

    monkeypatch.setattr(runner, "SCORE_ROWS", score_rows)
    prompts = _prompts([45, 30, 70], seed=0)
    llm = _llm(model_dir, max_num_batched_tokens=32)  # the 70-token prompt takes three chunks
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)]
    outs = llm.generate(prompts, params)
    _check(prompts[0], outs[0].prompt_logprobs, oracle(prompts[0]), 3)
    assert outs[1].prompt_logprobs is None
    _check(prompts[2], outs[2].prompt_logprobs, oracle(prompts[2]), 0)
    plain = _llm(model_dir).generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_a_cached_prefix_is_recomputed_to_be_scored(model_dir: Path, oracle) -> None:
    prompt = _prompts([64], seed=1)[0]
    llm = _llm(model_dir)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warms the cache
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0
    _check(prompt, out.prompt_logprobs, oracle(prompt), 1)
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert again.num_cached_tokens > 0  # other requests still use the cache


def test_preempted_requests_score_each_prompt_token_once(model_dir: Path, oracle) -> None:
    prompts = _prompts([40, 70, 33, 90, 55, 61, 47, 80], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, prompt_logprobs=1)
    small = _llm(model_dir, num_kv_blocks=40, max_model_len=160)
    outs = small.generate(prompts, params)
    assert small.engine.stats.preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(prompt, out.prompt_logprobs, oracle(prompt), 1)


def test_deltas_carry_them_once_and_bad_values_are_rejected(model_dir: Path) -> None:
    llm = _llm(model_dir)
    prompt = _prompts([20], seed=3)[0]
    eng = llm.engine
    eng.add_request("d", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=2,
                                                output_kind=RequestOutputKind.DELTA))
    outs = []
    for _ in range(50):
        outs += eng.step()
        if outs and outs[-1].finished:
            break
    assert outs[-1].finished
    assert len(outs[0].prompt_logprobs) == 20
    assert all(o.prompt_logprobs is None for o in outs[1:])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_offline_logprobs_are_vllms_logprob_objects(model_dir: Path,
                                                    oracle: Callable[[list[int]], torch.Tensor]) -> None:
    """vLLM's offline outputs hold Logprob objects: code ported from it reads `.logprob`, `.rank`
    and `.decoded_token` (plain floats raised AttributeError). Ranks against the oracle: 1.. for
    the top N by log-prob; a sampled (or prompt) token outside them has none; values stay floats."""
    llm = _llm(model_dir)
    prompt = _prompts([24], seed=9)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                   logprobs=2, prompt_logprobs=2))
    c = out.outputs[0]
    assert c.logprobs is not None and out.prompt_logprobs is not None
    outside = 0
    for tok, entry in zip(c.token_ids, c.logprobs):
        ranked = sorted((t for t in entry if entry[t].rank is not None), key=lambda t: entry[t].rank)
        assert [entry[t].rank for t in ranked] == [1, 2]
        assert entry[ranked[0]].logprob >= entry[ranked[1]].logprob
        assert all(entry[t].decoded_token == llm.tokenizer.decode([t]) for t in entry)
        if len(entry) == 3:  # the sampled token, outside the top 2: no rank known
            assert entry[tok].rank is None
            outside += 1
        assert isinstance(entry[tok], float) and entry[tok] == entry[tok].logprob
    ref = oracle(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        top = ref[i - 1].topk(2).indices.tolist()
        assert [entry[t].rank for t in top] == [1, 2]
        assert abs(entry[prompt[i]].logprob - ref[i - 1][prompt[i]].item()) < 1e-4
    assert outside > 0  # (a sampled run at temperature 1 leaves the top 2 somewhere in 12 tokens)
