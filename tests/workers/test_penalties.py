"""Presence, frequency and repetition penalties and logit bias.

Oracles: a float64 computation of the definitions (OpenAI's for presence and
frequency over generated tokens; CTRL's repetition penalty over prompt and
output, as transformers and vLLM apply it), transformers'
RepetitionPenaltyLogitsProcessor, and transformers `generate` on the tiny
model with the same processing, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pdserve import LLM, SamplingParams
from pdserve.workers.sampler import Penalties, SamplingBatch, apply_penalties, sample
from pdserve.workers.tiny.builder import TinyModelSpec

V = 50


def reference64(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
                repetition: float) -> torch.Tensor:
    """The definitions, token by token, in float64."""
    out = logits.double().clone()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= frequency * output.count(tok) + presence
    return out


def _histories(g: torch.Generator, n: int) -> list[tuple[list[int], list[int]]]:
    rows = []
    for i in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        out_len = 0 if i == 0 else int(torch.randint(1, 20, (1,), generator=g))  # row 0: nothing generated yet
        rows.append((prompt, torch.randint(0, V, (out_len,), generator=g).tolist()))
    return rows


def test_penalties_match_the_float64_definitions_row_by_row() -> None:
    g = torch.Generator().manual_seed(0)
    hist = _histories(g, 5)
    settings = [(0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, 1.3, 1.0), (-0.7, 0.4, 1.8), (1.1, -0.2, 0.6)]
    logits = torch.randn(5, V, generator=g) * 3
    pen = Penalties.build([(p, o, *s) for (p, o), s in zip(hist, settings)], V, torch.device("cpu"))
    got = apply_penalties(logits.clone(), pen)
    for i, ((p, o), s) in enumerate(zip(hist, settings)):
        torch.testing.assert_close(got[i].double(), reference64(logits[i], p, o, *s), rtol=1e-6, atol=1e-6)
    # The first row (no penalties) is untouched, bit for bit.
    assert torch.equal(got[0], logits[0])


def test_repetition_penalty_equals_transformers_processor() -> None:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (25,), generator=g).tolist()
    output = torch.randint(0, V, (9,), generator=g).tolist()
    logits = torch.randn(1, V, generator=g) * 4
    pen = Penalties.build([(prompt, output, 0.0, 0.0, 1.4)], V, torch.device("cpu"))
    got = apply_penalties(logits.clone(), pen)
    want = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, want)


def test_sample_applies_bias_and_penalties_to_greedy_rows_only_where_asked() -> None:
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0  # everyone's argmax
    batch = SamplingBatch(temperature=torch.zeros(3), all_greedy=True)
    batch.logit_bias = [(1, torch.tensor([3]), torch.tensor([10.0]))]
    batch.penalties = Penalties.build([([1], [], 0.0, 0.0, 1.0), ([1], [], 0.0, 0.0, 1.0),
                                       ([1], [7, 7], 0.0, 3.0, 1.0)], V, torch.device("cpu"))
    assert sample(logits, batch).token_ids.tolist() == [7, 3, 0]  # row 2: 5 - 2*3 < 0 = token 0's logit


# -- end to end against transformers generate ------------------------------------

SPEC = tiny_spec(init_std=0.05)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


class OpenAIPenalties(LogitsProcessor):
    """presence/frequency over the generated tokens only (OpenAI), plus a logit bias."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]) -> None:
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for tok, b in self.bias.items():
            scores[:, tok] += b
        for row in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len:], minlength=scores.shape[1]).float()
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # A short alphabet makes repeats likely, so the penalties change the output.
    return [torch.randint(5, 40, (length,), generator=g).tolist() for _ in range(n)]


def _llm(model_dir: Path, **kw: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False, **kw)


def _hf_greedy(hf, prompt: list[int], max_new: int, **kw: object) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_greedy_repetition_penalty_equals_transformers_generate(model_dir: Path, hf) -> None:
    prompts = _prompts(3, 20, seed=0)
    llm = _llm(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.6)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [_hf_greedy(hf, p, 24, repetition_penalty=1.6) for p in prompts]
    assert got == want
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                                  ignore_eos=True))]
    assert plain != got, "the penalty changed nothing: the test cannot tell"


def test_greedy_presence_frequency_and_bias_equal_transformers_generate(model_dir: Path, hf) -> None:
    prompts = _prompts(2, 16, seed=1)
    bias = {11: 1.5, 12: -100.0}
    llm = _llm(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=1.2, logit_bias=bias)
    # Batched with a request that asks for nothing of the kind: each row keeps its own settings.
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:1], [params, params, plain])
    for prompt, out in zip(prompts, outs):
        proc = LogitsProcessorList([OpenAIPenalties(len(prompt), 0.8, 1.2, bias)])
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 24, logits_processor=proc)
        assert 12 not in out.outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == _hf_greedy(hf, prompts[0], 24)
    assert outs[2].outputs[0].token_ids != outs[0].outputs[0].token_ids


def test_penalised_requests_do_not_draft_and_keep_their_output(model_dir: Path) -> None:
    """Speculation on: a penalised request is never drafted for (its penalties depend
    on every position's history) and its tokens equal the plain engine's."""
    prompts = _prompts(2, 24, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    want = [o.outputs[0].token_ids for o in _llm(model_dir).generate(prompts, params)]
    spec = _llm(model_dir, speculative="ngram", num_speculative_tokens=3, spec_token_cost=0.01)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.stats.spec_draft_tokens == 0
    # The same prompts without penalties are drafted for: the count above could have moved.
    spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert spec.engine.stats.spec_draft_tokens > 0


def test_bad_logit_bias_is_a_valueerror_and_harms_nothing(model_dir: Path) -> None:
    llm = _llm(model_dir)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=-1.0)
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_logit_bias_requests_draft_and_verification_applies_the_bias(model_dir: Path) -> None:
    """A bias is the same at every position: such requests draft, and every
    verified position sees it (greedy: the same tokens as without speculation)."""
    prompts = _prompts(2, 24, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={20: 2.5, 21: -100.0})
    want = [o.outputs[0].token_ids for o in _llm(model_dir).generate(prompts, params)]
    spec = _llm(model_dir, speculative="ngram", num_speculative_tokens=3, spec_token_cost=0.01)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.stats.spec_draft_tokens > 0
    plain = [o.outputs[0].token_ids for o in _llm(model_dir).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    assert plain != want, "the bias changed nothing: the test cannot tell"


def test_rows_without_penalties_count_nothing_and_come_out_untouched() -> None:
    """One penalized row beside rows with long prompts and none: the penalized row matches
    the float64 definitions, the others are untouched, and their tokens are never counted
    (counting every row's prompt made one penalized request cost the whole batch its longest
    prompt, every step)."""
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, V, (5000,), generator=g).tolist()
    hist = [(long, [1, 2, 3]), ([4, 5], [6, 6, 7]), (long, [])]
    settings = [(0.0, 0.0, 1.0), (0.3, 0.5, 1.4), (0.0, 0.0, 1.0)]
    logits = torch.randn(3, V, generator=g) * 3
    pen = Penalties.build([(p, o, *s) for (p, o), s in zip(hist, settings)], V, torch.device("cpu"))
    assert pen.output_counts[0].sum() == 0 and pen.output_counts[2].sum() == 0
    assert pen.seen is not None and not pen.seen[0].any() and not pen.seen[2].any()
    got = apply_penalties(logits.clone(), pen)
    torch.testing.assert_close(got[1].double(), reference64(logits[1], *hist[1], *settings[1]), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
