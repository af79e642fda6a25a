"""Engine behaviour users rely on: prefix cache, preemption, seeds, bad input, abort, stops."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec, with_bos_added

from pdserve import LLM, SamplingParams
from pdserve.workers.sampling_params import sample_seed
from pdserve.workers.tiny.builder import TinyModelSpec

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


def make_llm(model_dir: Path, **kw: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", max_model_len=512, num_kv_blocks=256, progress=False)
    args.update(kw)
    return LLM(str(model_dir), **args)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_get_tokenizer_is_vllms_accessor(model_dir: Path) -> None:
    """vLLM's `llm.get_tokenizer()` (how its users build prompts and decode ids) was an AttributeError."""
    llm = make_llm(model_dir)
    tok = llm.get_tokenizer()
    out = llm.generate("the tokenizer", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert tok is llm.tokenizer and tok.encode("the tokenizer") == out.prompt_token_ids
    assert tok.decode(out.outputs[0].token_ids) == out.outputs[0].text


def test_an_engine_argument_that_is_no_setting_is_refused_by_name(model_dir: Path) -> None:
    """`LLM(model, max_num_seq=8)` (a typo) ran with the default batch: the dataclass ignored a
    name it did not know. Now a ValueError names it; vLLM's arguments that always hold here
    (trust_remote_code, enable_chunked_prefill=True) are taken, as vLLM code passes them."""
    with pytest.raises(ValueError, match=r"max_num_seq: not an engine setting \(did you mean max_num_seqs\?\)"):
        LLM(str(model_dir), progress=False, max_num_seq=8)
    with pytest.raises(ValueError, match="enable_chunked_prefill: pdserve cannot take False"):
        LLM(str(model_dir), progress=False, enable_chunked_prefill=False)
    llm = LLM(str(model_dir), progress=False, trust_remote_code=True, enable_chunked_prefill=True, max_num_seqs=3)
    assert llm.engine.config.max_num_seqs == 3


def test_vllms_speculative_config_sets_speculation(model_dir: Path) -> None:
    """vLLM's `LLM(model, speculative_config={...})` was a ValueError (no such setting): it is the
    settings it names, and the engine's greedy tokens are those of plain decoding."""
    llm = LLM(str(model_dir), progress=False, max_model_len=256, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    cfg = llm.engine.config
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.spec_ngram_max) == ("ngram", 3, 2)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]
    want = make_llm(model_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="method 'eagle'"):
        LLM(str(model_dir), progress=False, speculative_config={"method": "eagle", "model": "/e"})


def test_prefix_cache_computes_only_uncached_tokens(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    shared = random_prompts([200], seed=3)[0]
    first, second = shared + random_prompts([13], seed=4)[0], shared + random_prompts([29], seed=5)[0]
    llm.generate([first], GREEDY)
    stats = llm.engine.stats
    before = stats.prompt_tokens_computed
    out = llm.generate([second], GREEDY)[0]
    cached = (200 // 16) * 16  # full blocks of the shared prefix
    assert out.num_cached_tokens == cached
    assert stats.prompt_tokens_computed - before == len(second) - cached
    # Same tokens as a cold engine computing everything.
    cold = make_llm(model_dir, enable_prefix_caching=False)
    assert tokens([out]) == tokens(cold.generate([second], GREEDY))


def test_preemption_completes_every_request_with_unchanged_output(model_dir: Path) -> None:
    prompts = random_prompts([40, 70, 33, 90, 55, 61, 47, 80])
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    reference = tokens(make_llm(model_dir).generate(prompts, params))
    # 8 requests need ~8 * 9 blocks at the end; 40 blocks cannot hold them at once.
    small = make_llm(model_dir, num_kv_blocks=40, max_model_len=160)
    outs = small.generate(prompts, params)
    assert small.engine.stats.preemptions > 0
    assert tokens(outs) == reference
    assert all(len(t) == 48 for t in tokens(outs))
    assert small.engine.kv.pool.num_free == 40


def test_seeded_request_same_tokens_alone_and_batched(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    prompt = random_prompts([37], seed=9)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    alone = tokens(llm.generate([prompt], seeded))[0]
    others = random_prompts([12, 80, 5], seed=10)
    noise = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
    batched = llm.generate([others[0], prompt, others[1], others[2]], [noise, seeded, noise, GREEDY])
    assert tokens(batched)[1] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=32, ignore_eos=True)
    assert tokens(llm.generate([prompt], other_seed))[0] != alone


@pytest.mark.parametrize(
    ("prompt", "params", "name"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([7] * 600, {}, "prompt"),
        ([7] * 10, {"max_tokens": 0}, "max_tokens"),
        ([7] * 10, {"temperature": -0.5}, "temperature"),
        ([7] * 10, {"top_p": 0.0}, "top_p"),
        ([7] * 10, {"top_p": 1.5}, "top_p"),
        ([7] * 500, {"max_tokens": 100}, "max_tokens"),
        ([99999], {}, "prompt"),
    ],
)
def test_bad_input_raises_valueerror_naming_the_parameter_and_harms_nothing(
    model_dir: Path, prompt: object, params: dict[str, object], name: str
) -> None:
    llm = make_llm(model_dir)
    engine = llm.engine
    good = random_prompts([20, 30], seed=11)
    expected = tokens(make_llm(model_dir).generate(good, GREEDY))
    engine.add_request("good-0", good[0], GREEDY)
    with pytest.raises(ValueError, match=name):
        engine.add_request("bad", prompt, SamplingParams(**{"max_tokens": 8, **params}))  # type: ignore[arg-type]
    engine.add_request("good-1", good[1], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["good-0"], done["good-1"]] == expected
    assert engine.kv.pool.num_free == engine.num_kv_blocks


def test_a_text_prompt_with_a_token_past_the_models_vocabulary_is_refused(model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """A tokenizer with more tokens than the model has embeddings (`tokenizer=` another model's,
    or tokens added without resizing): a text prompt's ids were never checked, and the id past
    the embedding table failed the step (compiled: an out-of-bounds abort of the process)."""
    extra = tmp_path / "extra"
    shutil.copytree(model_dir, extra)
    tok = json.loads((extra / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    tok["added_tokens"].append({"id": vocab, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (extra / "tokenizer.json").write_text(json.dumps(tok))
    llm = make_llm(model_dir, tokenizer=str(extra))
    assert llm.engine.model_config.vocab_size == vocab and llm.tokenizer.encode("hi <|extra|>")[-1] == vocab
    with pytest.raises(ValueError, match=f"^prompt: token ids must be integers in \\[0, {vocab}\\)"):
        llm.generate(["hi", "hi <|extra|>"], GREEDY)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0
    assert len(llm.generate(["hi"], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_generate_validates_every_prompt_before_running_any(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5, 6, 7], ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_every_samples_seed_of_a_valid_seed_is_valid(model_dir: Path) -> None:
    """Sample j's seed was seed + j: past 2**64 for the last of n, found only once the prompts
    before it were queued. Each sample's seed is now a mix of (seed, j), in range for any seed."""
    llm = make_llm(model_dir)
    edge = SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=4)  # valid on its own
    outs = llm.generate([[5, 6, 7], [8, 9, 10]], [GREEDY, edge])
    assert [len(o.outputs) for o in outs] == [1, 2]
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0


def test_neighbouring_seeds_with_n_share_no_sample(model_dir: Path) -> None:
    """With seed + j, seeds 7 and 8 at n=2 returned one sample twice (7's second, 8's first)."""
    llm = make_llm(model_dir)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    seven, eight = (llm.generate(random_prompts([10]), dataclasses.replace(params, seed=s))[0].outputs for s in (7, 8))
    texts = [c.token_ids for c in seven + eight]
    assert len({tuple(t) for t in texts}) == 4, texts
    assert sample_seed(7, 0) == 7 and sample_seed(None, 3) is None
    assert all(-(2**63) <= (sample_seed(s, j) or 0) < 2**63 for s in (0, -(2**63), 2**64 - 1) for j in range(1, 5))


def test_an_interrupted_generate_leaves_nothing_behind(model_dir: Path) -> None:
    """Ctrl-C in a notebook mid-generate: its requests stayed in the engine with their blocks,
    and the next generate ran them too and failed on their outputs (a KeyError)."""
    llm = make_llm(model_dir)
    step, calls = llm.engine.step, [0]

    def interrupted() -> list[Any]:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([9, 7], seed=4), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    llm.engine.step = step  # type: ignore[method-assign]
    out = llm.generate([[12, 13, 14]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0


def test_abort_frees_blocks_at_once(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    engine = llm.engine
    for i, p in enumerate(random_prompts([100, 60, 45])):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort(["r0", "r1", "r2", "unknown"])
    assert engine.kv.pool.num_used == 0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()


def test_stop_string_cuts_text_and_reports_reason(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    prompt = random_prompts([16], seed=21)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = full.text[10:13]
    assert len(stop) == 3
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    cut = llm.generate([prompt], params)[0].outputs[0]
    idx = full.text.find(stop)
    assert cut.text == full.text[:idx]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[: idx + len(stop)]
    # Before min_tokens a stop string neither stops nor cuts the text.
    late = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                 min_tokens=40))[0].outputs[0]
    assert late.text == full.text and late.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    prompt = random_prompts([16], seed=22)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # Its text is not in the output (vLLM's), unless include_stop_str_in_output.
    tok = llm.tokenizer
    assert out.text == tok.decode(full.token_ids[:first]) != tok.decode(full.token_ids[: first + 1])
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                 stop_token_ids=[stop_id], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == tok.decode(full.token_ids[: first + 1])
    # min_tokens forbids the stop token until that many tokens exist.
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop_id], min_tokens=first + 2))[0].outputs[0]
    assert stop_id not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2


def test_max_tokens_and_eos(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    out = llm.generate(random_prompts([9]), params)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_logprobs_are_raw_model_logprobs(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    prompt = random_prompts([12], seed=30)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top-1
        assert max(entry, key=entry.__getitem__) == token
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_n_samples_per_prompt(model_dir: Path) -> None:
    llm = make_llm(model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    outs = llm.generate(random_prompts([10, 14]), params)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert sorted(c.index for c in outs[0].outputs) == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    # Sample j is the request seeded sample_seed(seed, j), at index j (vLLM's numbering), whichever
    # finishes first: here the last sample stops on its second token, before the others.
    stop = dataclasses.replace(params, stop_token_ids=[outs[0].outputs[2].token_ids[1]])
    got = llm.generate(random_prompts([10]), stop)[0].outputs
    assert [c.index for c in got] == [0, 1, 2] and len(got[2].token_ids) == 2
    for j, c in enumerate(got):
        alone = llm.generate(random_prompts([10]), dataclasses.replace(stop, n=1, seed=sample_seed(5, j)))[0].outputs[0]
        assert c.token_ids == alone.token_ids, f"sample {j}"


def test_chunked_prefill_matches_one_shot_prefill(model_dir: Path) -> None:
    prompts = random_prompts([300, 150, 20])
    ref = tokens(make_llm(model_dir).generate(prompts, GREEDY))
    chunked = make_llm(model_dir, max_num_batched_tokens=64)
    assert tokens(chunked.generate(prompts, GREEDY)) == ref


def test_merged_deltas_equal_the_sequence() -> None:
    from pdserve.workers.outputs import CompletionOutput, RequestOutput, merge_deltas

    a = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [5, 6], logprobs=[{5: -1.0}, {6: -2.0}])], False)
    b = RequestOutput("r", None, [1], [CompletionOutput(0, "c", [7], logprobs=[{7: -0.5}], finish_reason="stop",
                                                        stop_reason=7)], True, num_cached_tokens=3)
    m = merge_deltas(a, b)
    c = m.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason, m.finished) == ("abc", [5, 6, 7], "stop", 7, True)
    assert c.logprobs == [{5: -1.0}, {6: -2.0}, {7: -0.5}] and m.num_cached_tokens == 3


def test_chat_renders_the_template_once_as_vllm(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's `llm.chat(messages)` was an AttributeError. The template's text is the prompt, its
    own special tokens only: a tokenizer that adds BOS must not add a second one."""
    llm = make_llm(with_bos_added(model_dir, tmp_path / "bos"))
    tok = llm.tokenizer
    assert tok.encode("hi")[0] == tok.bos_token_id  # the tokenizer adds BOS ...
    convs = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "what is a cache?"}]]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    assert all(t.startswith(tok.bos_token) for t in texts)  # ... and so does the template
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.chat(convs, params)
    for out, text in zip(outs, texts):
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt == text and out.prompt_token_ids == ids and ids.count(tok.bos_token_id) == 1
        assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    one = llm.chat(convs[0], params)  # one conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat(["hi"], params)  # type: ignore[list-item]
    # vLLM's chat_template_kwargs: the template's variables (Qwen3's enable_thinking); the renderer's
    # own arguments are refused by name.
    thinking = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if not enable_thinking %}<no-think>{% endif %}"
    off = llm.chat(convs[0], params, chat_template=thinking, chat_template_kwargs={"enable_thinking": False})
    assert off[0].prompt == "hi<no-think>"
    with pytest.raises(ValueError, match="^chat_template_kwargs: 'tools'"):
        llm.chat(convs[0], params, chat_template_kwargs={"tools": []})
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0
