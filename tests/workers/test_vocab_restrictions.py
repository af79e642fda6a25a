"""vLLM's `allowed_token_ids` and `bad_words`, against transformers `generate` on the tiny model
with the same restriction (`prefix_allowed_tokens_fn`; `bad_words_ids`), token for token, and
under speculation and async scheduling against the plain engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.workers.bad_words import bad_words_token_ids, banned_by_words
from pdserve.workers.tiny.builder import TinyModelSpec

MAX_NEW = 20


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(init_std=0.05))


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return _llm(model_dir)


def _llm(model_dir: Path, **kw: object) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False, **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 200, (12,), generator=g).tolist() for _ in range(n)]


def _greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _hf_greedy(hf, prompt: list[int], **kw: object) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_allowed_token_ids_greedy_equals_transformers_restricted(llm: LLM, hf) -> None:
    prompts = _prompts(2, seed=0)
    plain = _tokens(llm, prompts, _greedy())
    # Some tokens the plain output takes (so the restriction bites at some steps and not others).
    allowed = sorted({plain[0][1], plain[0][4], plain[1][2], 7, 300, 999})
    got = _tokens(llm, prompts + prompts[:1], [_greedy(allowed_token_ids=allowed)] * 2 + [_greedy()])
    for prompt, out in zip(prompts, got):
        assert out == _hf_greedy(hf, prompt, prefix_allowed_tokens_fn=lambda _b, _ids: allowed)
        assert set(out) <= set(allowed)
    assert got[2] == plain[0], "a request batched with a restricted one keeps its own output"
    assert got[0] != plain[0], "the restriction changed nothing: the test cannot tell"


def test_sampled_tokens_stay_in_allowed_token_ids(llm: LLM) -> None:
    allowed = [5, 17, 401, 402]
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed,
                            top_p=0.95, min_p=0.01, logprobs=2)
    out = llm.generate(_prompts(1, seed=1), params)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    # logprobs are the model's own (raw) distribution, as vLLM returns them: the restriction
    # shapes what is sampled, not the reported log-probabilities.
    assert out.logprobs is not None and all(len(e) >= 2 for e in out.logprobs)


def test_bad_words_greedy_equals_transformers_bad_words_ids(llm: LLM, hf) -> None:
    prompts = _prompts(2, seed=2)
    plain = _tokens(llm, prompts, _greedy())
    tok = llm.tokenizer
    # Words the plain outputs say: one of a single token and one of two.
    words = [tok.decode(plain[0][3:4]), tok.decode(plain[1][5:7])]
    ids = bad_words_token_ids(words, tok, llm.engine.model_config.vocab_size)
    assert ids, words
    got = _tokens(llm, prompts, _greedy(bad_words=words))
    for prompt, out in zip(prompts, got):
        # transformers checks a word's prefix against the prompt too; pdserve (as vLLM) against the
        # output only: the same wherever the prompt does not end with a word's first tokens.
        assert not any(w[:-1] and prompt[-len(w) + 1:] == w[:-1] for w in ids)
        assert out == _hf_greedy(hf, prompt, bad_words_ids=ids)
        for w in ids:
            assert not any(out[i:i + len(w)] == w for i in range(len(out))), (w, out)
    assert got != plain, "the bad words changed nothing: the test cannot tell"


def test_bad_words_take_the_word_after_a_space_too() -> None:
    """vLLM's rule: a word's tokens alone, and after a space where that is another sequence of
    the same length (byte-level BPE: " cat" is one token, "cat" another)."""
    vocab = {"cat": [10], " cat": [11], "dog house": [20, 21], " dog house": [22, 23, 24]}

    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return vocab[text]

    assert bad_words_token_ids(["cat", "  dog house"], Tok(), 100) == [[10], [11], [20, 21]]
    assert bad_words_token_ids(["cat"], Tok(), 11) == [[10]], "an id past the model's vocabulary is left out"
    assert banned_by_words([[10], [20, 21]], [5, 20]) == [10, 21]
    assert banned_by_words([[10], [20, 21]], [20, 5]) == [10]
    assert banned_by_words([[20, 21]], []) == []


def test_restricted_requests_under_speculation_and_async_scheduling_keep_their_output(model_dir: Path,
                                                                                      llm: LLM) -> None:
    """allowed_token_ids applies at every verified position (such requests draft); bad words
    depend on the output so far, so their requests draft nothing and wait for their last token."""
    prompts = [p[:4] * 4 for p in _prompts(2, seed=4)]  # repeats: n-gram drafts find something
    plain = _tokens(llm, prompts, _greedy())
    allowed = sorted(set(plain[0][:6]) | {9, 10})
    words = [llm.tokenizer.decode(plain[1][2:4])]
    params = [_greedy(allowed_token_ids=allowed), _greedy(bad_words=words)]
    want = _tokens(llm, prompts, params)
    spec = _llm(model_dir, speculative="ngram", num_speculative_tokens=3, spec_token_cost=0.01)
    assert _tokens(spec, prompts, params) == want
    drafted = spec.engine.stats.spec_draft_tokens
    assert drafted > 0, "the allowed-tokens request drafts"
    assert _tokens(spec, prompts[1:], params[1:]) == want[1:]
    assert spec.engine.stats.spec_draft_tokens == drafted, "the bad-words request drafted"
    overlapped = _llm(model_dir, async_scheduling=True)
    assert _tokens(overlapped, prompts, params) == want
    spec.close()
    overlapped.close()


def test_bad_restrictions_are_valueerrors_and_harm_nothing(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    for kw, field in [({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed"),
                      ({"allowed_token_ids": [1.5]}, "allowed"), ({"bad_words": "cat"}, "bad_words"),
                      ({"bad_words": [" "]}, "bad_words"), ({"bad_words": ["w"] * 129}, "bad_words")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, allowed_token_ids=[3, vocab]))
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished_requests()


def test_a_request_whose_restrictions_leave_no_token_fails_alone(llm: LLM) -> None:
    """allowed_token_ids of the stop token alone under min_tokens: nothing is left to sample.
    That is the client's error naming the field (a ValueError here, a 400 when served), not
    the server's "no finite logits"; the engine is left clean."""
    eos = llm.tokenizer.eos_token_id
    prompts = _prompts(2, seed=5)
    want = _tokens(llm, prompts[1:], _greedy())
    with pytest.raises(ValueError, match="allowed_token_ids: every token it allows at output token 0 is banned"):
        llm.generate(prompts, [SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos]), _greedy()])
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished_requests()
    assert _tokens(llm, prompts[1:], _greedy()) == want
    # A bad word the structured output needs: the same, naming the structured output (it was the
    # engine's "its logits had no finite choice", a 500, found by fuzzing the API).
    with pytest.raises(ValueError, match="structured_outputs.choice: every token it allows at output token 0"):
        llm.generate(prompts, [SamplingParams(max_tokens=4, bad_words=["a"], structured_outputs={"choice": ["a"]}),
                               _greedy()])
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the answer to the prompt's last N tokens, whatever came
    before them; -1 keeps what the context holds, more than it is refused."""
    long = _prompts(1, seed=6)[0] * 30  # 360 tokens: past max_model_len (256)
    want = _tokens(llm, [long[-50:]], _greedy())
    out = llm.generate([long], _greedy(truncate_prompt_tokens=50))[0]
    assert out.outputs[0].token_ids == want[0] and out.prompt_token_ids == long[-50:]
    with pytest.raises(ValueError, match="max_model_len|positions|context"):
        llm.generate([long], _greedy())
    # -1: what the context holds, which leaves no room to generate (as vLLM has it); shorter: untouched.
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([long], _greedy(truncate_prompt_tokens=-1))
    assert llm.generate([long[:40]], _greedy(truncate_prompt_tokens=-1))[0].prompt_token_ids == long[:40]
    for bad in (0, -2, 257):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.generate([long], _greedy(truncate_prompt_tokens=bad))
    assert llm.engine.kv.pool.num_used == 0
