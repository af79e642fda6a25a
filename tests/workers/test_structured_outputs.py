"""Structured outputs (workers/grammar.py): whatever the model, an output under a JSON
schema, a regex, a choice or a grammar matches it. The tiny random model is the hard case:
its logits are noise, so only the mask makes the output valid. Checked with `jsonschema`
(the oracle) over 200 schemas generated from a fixed seed, greedy and sampled."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from factories import tiny_spec
from spec_decode_helpers import FixedDrafts, check_law_kept, prompts, target_dir

from pdserve import LLM, SamplingParams
from pdserve.cluster.bench.schemas import schemas as random_schemas
from pdserve.workers.handoff import Resume
from pdserve.workers.structured_outputs import StructuredOutputs
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def llm(make_model: Callable[[TinyModelSpec], Path]) -> LLM:
    path = make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))
    return LLM(str(path), max_model_len=1024, max_num_seqs=64, progress=False)


@pytest.fixture(scope="module")
def ngram_llm(make_model: Callable[[TinyModelSpec], Path]) -> LLM:
    path = make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))
    return LLM(str(path), max_model_len=1024, max_num_seqs=64, progress=False, speculative="ngram",
               num_speculative_tokens=3)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_under_a_json_schema_is_valid(llm: LLM, ngram_llm: LLM, temperature: float,
                                                   speculative: str | None) -> None:
    """With n-gram drafts as well (prompts that repeat the schema's words, so drafts are
    proposed and some cut by the grammar); greedy, the same tokens as without drafts."""
    schemas = random_schemas(48, 200)
    # Sampled: unseeded, since a seeded sampled request does not speculate.
    params = [SamplingParams(temperature=temperature, seed=i if temperature == 0.0 else None, max_tokens=400,
                             structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    prompts = [f"record {i}: " + json.dumps(s)[:200] for i, s in enumerate(schemas)]
    drafted = ngram_llm.engine.stats.spec_draft_tokens
    outs = (ngram_llm if speculative else llm).generate(prompts, params)
    for s, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (s, c.text)
        jsonschema.validate(json.loads(c.text), s)
    if speculative:
        assert ngram_llm.engine.stats.spec_draft_tokens > drafted
        if temperature == 0.0:
            assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids
                                                                for o in llm.generate(prompts, params)]


def test_unconstrained_rows_in_the_same_batch_are_unchanged(llm: LLM) -> None:
    """The mask touches only its own row: a plain greedy request batched beside constrained
    ones gives what it gives alone."""
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["the plain one"], plain)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json_object": True})
    mixed = llm.generate(["the plain one", "json please", "more json"], [plain, constrained, constrained])
    assert mixed[0].outputs[0].token_ids == alone
    for out in mixed[1:]:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_choice_regex_and_grammar_hold(llm: LLM) -> None:
    choices = ["yes", "no", "maybe so", "it's \"quoted\""]
    outs = llm.generate([f"q{i}" for i in range(12)],
                        SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs={"choice": choices}))
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)

    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outs = llm.generate([f"q{i}" for i in range(12)],
                        SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs={"regex": pattern}))
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]

    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = llm.generate([f"q{i}" for i in range(12)],
                        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs={"grammar": ebnf}))
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.outputs[0].text), o.outputs[0].text


def test_a_grammar_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(["pick"], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                                structured_outputs={"choice": ["alpha", "beta"]}))[0]
    assert out.outputs[0].text in ("alpha", "beta") and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(("spec", "field"), [
    ({"json": '{"type": "objectx"}'}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
    ({"nonsense": 1}, "structured_outputs"),
    ({"json": {"type": "object"}, "whitespace_pattern": "[ ]?"}, "structured_outputs.whitespace_pattern"),
    ({"json": {"type": "object"}, "disable_additional_properties": True},
     "structured_outputs.disable_additional_properties"),
    ({"json": {"type": "object"}, "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
    # xgrammar's own words, without its internals ("Check failed: (...) is false: ..."):
    ({"json": {"const": "\ud800"}}, "structured_outputs.json: not valid Unicode (a lone surrogate)"),
    ({"json": {"type": "integer", "minimum": 10**30}}, "structured_outputs.json: Integer exceeds maximum limit"),
])
def test_a_bad_spec_is_a_value_error_naming_its_field_and_runs_nothing(llm: LLM, spec: dict[str, Any],
                                                                       field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids


def test_a_spec_that_dead_ends_is_a_value_error_offline_too(llm: LLM) -> None:
    """It compiles and allows a first token, then nothing: served, the client's 400. Offline,
    `generate` returned its output as if it had ended (finish_reason "abort", text "a"), the
    error only in a field vLLM's RequestOutput does not have."""
    dead_end = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"regex": "a[^\\s\\S]"})
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: no output can match it.*prompts\[1\]"):
        llm.generate(["a long one first", "Answer:"], [plain, dead_end])
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used == 0
    assert len(llm.generate(["Answer:"], plain)[0].outputs[0].token_ids) == 30


def test_vllms_options_that_ask_nothing_new_are_taken(llm: LLM) -> None:
    """A request written for vLLM (`disable_any_whitespace`, `disable_fallback`) runs: pdserve's
    JSON has no free whitespace and there is one backend. They were a 400 ('unexpected keyword')."""
    spec = {"json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["a"], "additionalProperties": False}}
    plain = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec))[0]
    flagged = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={
        **spec, "disable_any_whitespace": True, "disable_fallback": True}))[0]
    assert flagged.outputs[0].text == plain.outputs[0].text and json.loads(flagged.outputs[0].text)["a"] in range(10)


def test_a_resumed_request_replays_its_tokens_into_the_grammar(llm: LLM) -> None:
    """Migration: another worker's output so far is taken as this one's, and the grammar
    goes on from after it, as if the request had never moved (greedy: the same tokens)."""
    spec = {"json": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                                      "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                     "required": ["a", "b"], "additionalProperties": False}}
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spec)
    whole = llm.generate(["resume me"], params)[0].outputs[0]
    assert whole.finish_reason == "stop"
    cut = 4
    head = Resume(tuple(whole.token_ids[:cut]), len(llm.engine.tokenizer.decode(whole.token_ids[:cut])), None)
    eng = llm.engine
    eng.add_request("resumed", llm.engine.tokenizer.encode("resume me"), params, resume=head)
    rest: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                rest = out.outputs[0].token_ids
    assert rest == whole.token_ids


def test_resumed_tokens_the_grammar_refuses_fail_the_request_alone(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": ["yes", "no"]})
    bad = llm.engine.tokenizer.encode("zzz")
    eng.add_request("bad-resume", [5, 6, 7], params, resume=Resume(tuple(bad), len("zzz"), None))
    errors = []
    while eng.has_unfinished_requests():
        errors += [out.error for out in eng.step() if out.finished and getattr(out, "error", None)]
    assert errors and "does not match the grammar" in errors[0]


def test_speculative_engine_keeps_constrained_requests_valid(make_model: Callable[[TinyModelSpec], Path]) -> None:
    path = make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))
    spec_llm = LLM(str(path), max_model_len=512, progress=False, speculative="ngram", num_speculative_tokens=3)
    plain_llm = LLM(str(path), max_model_len=512, progress=False)
    so = {"json": {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["ab", "ab ab"]},
                                                           "maxItems": 8}},
                   "required": ["xs"], "additionalProperties": False}}
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    prompts = ["ab ab ab ab ab ab", "xs xs xs"]
    fast = spec_llm.generate(prompts, params)
    plain = plain_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    for o in fast:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), so["json"])


def test_spec_shape_checks() -> None:
    assert StructuredOutputs(json='{"type":  "object"}').key() == ("json", '{"type":"object"}')
    assert StructuredOutputs(choice=["a", "b"]).key() == ("choice", '["a", "b"]')
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputs(choice="ab")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


@pytest.mark.parametrize("form", ["structures", "format"])
def test_a_structural_tags_schema_is_held_to_a_json_schemas_bounds(form: str) -> None:
    """A schema inside a structural tag compiles as a `json` one does (2,000 properties: as many
    seconds, on a compile thread no 400 frees), so the same bound refuses it before any compile;
    it was taken, and compiled."""
    from pdserve.workers.structured_outputs import MAX_SCHEMA_PROPERTIES

    schema = {"type": "object", "properties": {f"a{i}": {"type": "string"} for i in range(2000)}}
    tag: dict[str, Any] = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]}
    if form == "format":
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}]}}
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.structural_tag: more than "
                                                   f"{MAX_SCHEMA_PROPERTIES} properties")):
        StructuredOutputs(structural_tag=tag)


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "uniqueItems": True,
     "minItems": 2, "maxItems": 3},
    {"type": "array", "items": DIGIT, "contains": {"const": 2}, "minItems": 1, "maxItems": 3},
    {"type": "integer", "minimum": 0, "maximum": 1, "not": {"const": 0}},
    {**DIGIT, "if": {"minimum": 5}, "then": {"const": 7}, "else": {"const": 2}},
    {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a"], "additionalProperties": False,
     "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a"], "additionalProperties": False,
     "dependentSchemas": {"a": {"required": ["b"]}}},
    {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]},
    # A pattern's literal quote, backslash or control character went into the JSON string raw:
    # '"a"b"' does not parse, '"a\\b"' is a backspace, a raw tab is no JSON.
    {"type": "string", "pattern": '^a"b$'},
    {"type": "string", "pattern": r"^a\\b$"},
    {"type": "string", "pattern": r"^a\tb$"},
    {"type": "object", "patternProperties": {r"^k\n$": {"type": "integer"}}, "minProperties": 1,
     "additionalProperties": False},
    # Found by fuzzing the API: "" under an empty anyOf (no JSON), "" for a remote $ref (ignored),
    # {} against a required property nothing allows, a negative bound read as 0.
    {"anyOf": []},
    {"$ref": "http://example.com/x.json"},
    {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
    {"type": "string", "maxLength": -1},
], ids=["uniqueItems", "contains", "not", "if-then-else", "dependentRequired", "dependentSchemas", "allOf",
        "pattern-quote", "pattern-backslash", "pattern-tab", "patternProperties-newline", "anyOf-empty",
        "remote-ref", "required-forbidden", "negative-maxLength"])
def test_a_schema_is_held_to_every_keyword_or_refused(llm: LLM, schema: dict[str, Any]) -> None:
    """xgrammar compiles these keywords as if they were absent: outputs such as [1, 1] under
    uniqueItems, or 0 under not {const: 0}, came back as `stop`, not instances of the schema. A
    client relies on the output validating (jsonschema: the oracle), or on a ValueError (a 400)
    naming the field, as vLLM's xgrammar backend refuses uniqueItems and contains."""
    try:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs={"json": schema})
                  for i in range(16)]
        outs = llm.generate([f"value {i}:" for i in range(16)], params)
    except ValueError as e:
        assert "structured_outputs.json" in str(e)
        return
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)


# -- with speculative decoding -------------------------------------------------------

ABCDE = r"[a-e]{12}x"  # no end within 3 tokens (a token of these letters is at most 4 of them)


def test_drafts_the_grammar_refuses_are_cut_and_output_equals_plain(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Drafts with tokens the grammar refuses (a drafter knows nothing of it): each draft is cut
    at its first refused token, what is left is verified under the mask at every position, and
    greedy output equals the engine without speculation."""
    path = target_dir(make_model)
    tok = LLM(str(path), max_model_len=256, progress=False).engine.tokenizer
    letters = [i for t, i in tok.get_vocab().items() if t and set(t) <= set("abcde")]
    junk = tok.encode(" zz!", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": ABCDE})
    plain = LLM(str(path), max_model_len=256, progress=False).generate(prompts(4), params)
    spec = LLM(str(path), max_model_len=256, progress=False, speculative="ngram", num_speculative_tokens=3,
               spec_max_batch_size=64, spec_token_cost=0.001)
    spec.engine.spec.proposer = FixedDrafts([letters[0], junk[0], letters[1]])  # type: ignore[union-attr]
    got = spec.generate(prompts(4), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    st = spec.engine.stats
    assert st.spec_draft_tokens > 0 and st.spec_draft_tokens == st.spec_drafts  # every draft cut to its 1 valid token
    assert all(re.fullmatch(r"[a-e]{1,12}x?", o.outputs[0].text) for o in got)


def test_sampling_with_speculation_under_a_grammar_keeps_the_targets_law(
        make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The joint law of the first 3 sampled tokens (temperature 0.8, top-k 4 of the tokens the
    grammar allows at each position: 64 outcomes), drafts verified under the grammar's masks,
    equals the exact one: float64 logits from transformers, masked by the grammar along each
    prefix. The bound as in test_spec_decode; a verifier that accepts every draft (the negative
    control) breaks it."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = target_dir(make_model)
    prompt = prompts()[1][:24]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=3, ignore_eos=True, detokenize=False,
                            structured_outputs={"regex": ABCDE})
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(path)), vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info).compile_regex(ABCDE)

    def law(prefix: tuple[int, ...]) -> dict[int, float]:
        matcher = xgr.GrammarMatcher(grammar)
        assert all(matcher.accept_token(t) for t in prefix)
        mask = xgr.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = torch.tensor([(int(mask[0, i // 32]) >> (i % 32)) & 1 for i in range(vocab)], dtype=torch.bool)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1] / 0.8
        top = logits.masked_fill(~allowed, float("-inf")).topk(4)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        exact = {seq + (t,): p * q for seq, p in exact.items() for t, q in law(seq).items()}
    check_law_kept(path, prompt, params, exact, monkeypatch)


def test_grammar_counts_reach_the_snapshot(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """What the worker's metrics export: requests, compiles (one per distinct spec), cache hits
    (the rest), compile and mask seconds."""
    llm = LLM(str(target_dir(make_model)), max_model_len=256, progress=False)
    before = llm.engine.snapshot()
    assert (before.constrained_requests, before.grammar_compiles, before.grammar_cache_hits) == (0, 0, 0)
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"regex": r}) for r in
              ("[a-e]{3}", "[a-e]{3}", "[0-9]{2}", "[a-e]{3}")]
    llm.generate(["a", "b", "c", "d"], params)
    snap = llm.engine.snapshot()
    assert (snap.constrained_requests, snap.grammar_compiles, snap.grammar_cache_hits) == (4, 2, 2)
    assert snap.grammar_compile_s > 0 and snap.grammar_mask_s > 0


def test_a_worker_compiles_off_its_event_loop_and_refuses_a_bad_spec(
        make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncEngine (what a worker serves with) awaits the compile on the compile thread, and builds
    its compiler (which reads the whole vocabulary: ~0.14 s for SmolLM2's 49k tokens, more for
    Llama 3's 128k) off the loop too; a spec that does not compile is the request's ValueError,
    naming its field, and nothing runs."""
    import asyncio
    import threading

    from pdserve.workers import engine as engine_module
    from pdserve.workers.async_engine import AsyncEngine

    built_on: list[threading.Thread] = []
    real = engine_module.GrammarCompiler

    def recording(*args: object, **kwargs: object) -> object:
        built_on.append(threading.current_thread())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "GrammarCompiler", recording)
    engine = AsyncEngine(LLM(str(target_dir(make_model)), max_model_len=256, progress=False).engine).start()

    async def run() -> str:
        loop_thread = threading.current_thread()
        text = ""
        async for out in engine.generate("ok", "x", SamplingParams(temperature=0.0, max_tokens=10,
                                                                   structured_outputs={"choice": ["yes", "no"]})):
            text += out.outputs[0].text
        assert len(built_on) == 1 and built_on[0] is not loop_thread, "the compiler was built on the event loop"
        with pytest.raises(ValueError, match=re.escape("structured_outputs.regex")):
            async for _ in engine.generate("bad", "x", SamplingParams(max_tokens=4, structured_outputs={"regex": "("})):
                pass
        return text

    try:
        assert asyncio.run(run()) in ("yes", "no")
    finally:
        engine.close()


@pytest.mark.parametrize("form", ["structures", "format"])
def test_a_structural_tag_constrains_what_follows_its_trigger(llm: LLM, form: str) -> None:
    """Free text until a trigger; after it, the tag's begin, a JSON instance of its schema, its end
    (vLLM's `structures` form and xgrammar's `format` form). The noise model would rarely write the
    trigger itself: the output starts with it (a resumed request's tokens, replayed into the
    grammar), and what follows must be the schema's JSON and the end tag."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    tag: dict[str, Any] = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f"]}
    if form == "format":
        content = {"type": "json_schema", "json_schema": schema}
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"type": "tag", "begin": "<f>", "content": content, "end": "</f>"}]}}
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=300, structured_outputs={"structural_tag": tag})
    eng, tok = llm.engine, llm.engine.tokenizer
    head = tok.encode("<f>", add_special_tokens=False)
    for i in range(8):
        eng.add_request(f"tag-{form}-{i}", tok.encode(f"p{i}"), dataclasses.replace(params, seed=i),
                        resume=Resume(tuple(head), 3, None))
    texts = []
    while eng.has_unfinished_requests():
        texts += [tok.decode(o.outputs[0].token_ids) for o in eng.step() if o.finished]
    assert len(texts) == 8
    # A tag's JSON may hold any whitespace (xgrammar's structural tags), which the noise model
    # writes at length: most close within max_tokens, and every one that closes validates.
    bodies = [m.group(1) for m in (re.match(r"<f>(.*?)</f>", t, re.S) for t in texts) if m is not None]
    assert len(bodies) >= 4, texts
    for body in bodies:
        jsonschema.validate(json.loads(body), schema)


def test_a_preempted_request_keeps_its_grammar(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Preemption frees a request's blocks and recomputes its tokens later; its matcher stays
    where its output is: the answers equal those of an engine with room, and validate."""
    path = target_dir(make_model)
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 60}},
              "required": ["s"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=100,
                             structured_outputs={"json": schema}) for i in range(8)]
    # Text prompts: random token ids can end in half a UTF-8 character, which the first output
    # text would carry (the detokenizer's, not the grammar's).
    prompts = [f"record {i}: " + "the quick brown fox " * (2 + i // 2) for i in range(8)]
    roomy = LLM(str(path), max_model_len=192, progress=False).generate(prompts, params)
    small = LLM(str(path), max_model_len=192, num_kv_blocks=16, progress=False)
    tight = small.generate(prompts, params)
    assert small.engine.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    for o in tight:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


class _SampledDrafts:
    """A draft model's contract: one draft a request sampled from q, q handed to verification;
    q is half on a token the grammar refuses, half on one it allows (a draft model samples
    without the grammar)."""

    def __init__(self, vocab: int, refused: int, valid: int) -> None:
        self.q = torch.zeros(vocab)
        self.q[refused] = self.q[valid] = 0.5
        self.gen = torch.Generator().manual_seed(0)

    def draft(self, requests: list[Any], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        xs = torch.multinomial(self.q, len(requests), replacement=True, generator=self.gen).tolist()
        return [[x] for x in xs], [self.q[None].clone() for _ in requests]

    def retain(self, request_ids: set[str]) -> None:
        pass


def test_sampled_drafts_the_grammar_refuses_keep_the_targets_law(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A draft sampled from q that the grammar refuses was cut, and its position drawn from p:
    whether it was cut hung on the draft drawn, so the output left the target's law (with q
    half on a refused token and half on an allowed one A, P(A) rose ~1.5x). Kept, verification
    rejects it (p is 0 there) and draws from the residual, as with any rejected draft."""
    import torch

    path = target_dir(make_model)
    n = 2000
    plain = LLM(str(path), max_model_len=128, max_num_seqs=256, progress=False)
    tok = plain.engine.tokenizer
    bar = tok.convert_tokens_to_ids("|")  # the regex makes it first, and refuses it second
    a, b = (tok.convert_tokens_to_ids(t) for t in ("ing", "the"))
    assert tok.unk_token_id not in (a, b, bar) and a != b
    prompt = [int(x) for x in torch.randint(5, 4000, (12,), generator=torch.Generator().manual_seed(3))]
    params = SamplingParams(temperature=1.0, max_tokens=3, logit_bias={a: 6.5, b: 6.5},
                            structured_outputs={"regex": r"\|[a-z]+"})
    want = sum(o.outputs[0].token_ids[1] == a for o in plain.generate([prompt] * n, params)) / n
    spec = LLM(str(path), max_model_len=128, max_num_seqs=256, progress=False, speculative="ngram",
               num_speculative_tokens=1, spec_max_batch_size=256, spec_token_cost=0.001)
    assert spec.engine.spec is not None
    spec.engine.spec.proposer = _SampledDrafts(spec.engine.runner.vocab_size, bar, a)  # type: ignore[assignment]
    outs = spec.generate([prompt] * n, params)
    assert all(o.outputs[0].token_ids[0] == bar for o in outs)
    got = sum(o.outputs[0].token_ids[1] == a for o in outs) / n
    assert abs(got - want) < 0.06, f"P(A) {got:.3f} with sampled drafts, {want:.3f} without"  # ~5 sigma
    assert spec.engine.stats.spec_drafts > n // 2  # refused drafts too go to verification


def test_a_grammar_that_does_not_compile_in_time_is_refused(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import pdserve.workers.engine as engine_module
    from pdserve.workers.grammar import GrammarCompiler

    real = GrammarCompiler._compile

    def slow(self: GrammarCompiler, spec: StructuredOutputs) -> Any:
        time.sleep(0.5)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    monkeypatch.setattr(engine_module, "GRAMMAR_COMPILE_TIMEOUT_S", 0.05)
    with pytest.raises(ValueError, match=r"structured_outputs.regex: did not compile within 0.05 s"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs={"regex": "[q-z]{7}"}))
    assert not llm.engine.has_unfinished_requests()


def test_a_slow_grammar_does_not_hold_up_another_requests_grammar(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schema that takes long to compile (one client's) does not delay another client's small
    one: with one compile thread the small one waited the whole compile, and past the compile
    deadline it was refused (a 400) though it compiles in milliseconds."""
    from pdserve.workers import structured_outputs
    from pdserve.workers.grammar import GrammarCompiler

    monkeypatch.setattr(structured_outputs, "MAX_SCHEMA_PROPERTIES", 10_000)  # a slow one, past the bound

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, (0,))
    width = 1500  # ~1-2 s to compile on a 2-core machine
    big = {"type": "object", "required": [f"p{i}" for i in range(width)],
           "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{5 + i % 7}}}[0-9]{{2,{3 + i % 5}}}$"}
                          for i in range(width)}}
    slow = compiler.submit(StructuredOutputs(json=big))
    fast = compiler.submit(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    fast.result(timeout=60)
    assert not slow.done(), "the small grammar waited for the big one"
    slow.result(timeout=120)
    assert compiler.stats.compiles == 2


def test_compiles_every_waiter_gave_up_on_leave_the_queue(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sending schemas that each take longer than the compile deadline: each request is
    refused, and its compile must not stay queued (they piled up without bound, and every later
    grammar waited behind them). A compile a request in the engine holds is never dropped."""
    import threading

    from pdserve.workers import grammar as grammar_module
    from pdserve.workers.grammar import GrammarCompiler

    gate = threading.Event()
    real = GrammarCompiler._compile
    started: list[str] = []

    def stuck(self: GrammarCompiler, spec: StructuredOutputs) -> Any:
        started.append(spec.key()[1])
        gate.wait(30)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", stuck)
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.runner.vocab_size, (0,))
    try:
        threads = grammar_module.COMPILE_THREADS
        specs = [StructuredOutputs(regex=f"[a-z]{{{i + 1}}}") for i in range(threads + 12)]
        for spec in specs:  # the first `threads` run (stuck); the rest queue behind them
            with pytest.raises(TimeoutError):
                compiler.wait(spec, 0.01)
        held = StructuredOutputs(regex="[0-9]{3}")
        state = compiler.state(held)  # queued too, but a request holds it
        gate.set()
        assert state._compiled.result(timeout=30) is not None
        compiler.wait(specs[-1], 30)  # given up on before: compiled afresh when asked again (queued last)
        ran = [s.key()[1] for s in specs[:threads]] + [held.key()[1], specs[-1].key()[1]]
        assert sorted(started) == sorted(ran), "compiles ran for requests already refused"
    finally:
        gate.set()
        compiler.close()


def test_compiled_grammars_are_kept_only_within_the_cache_bound(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker (and the gateway) keeps at most CACHE_ENTRIES compiled grammars. xgrammar's own
    compile cache, unbounded by default, kept every grammar ever compiled besides: each distinct
    schema a client sent grew the process's memory for good."""
    from pdserve.workers import grammar as grammar_module
    from pdserve.workers.grammar import GrammarCompiler

    monkeypatch.setattr(grammar_module, "CACHE_ENTRIES", 2)
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.runner.vocab_size, (0,))
    try:
        sizes = [compiler.compile(StructuredOutputs(json={
            "type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 4}}, "required": [f"k{i}"]})
        ).memory_size_bytes for i in range(24)]
        assert len(compiler._cache) == 2
        held = compiler._compiler.get_cache_size_bytes()
        assert held <= 2 * max(sizes), f"{held} bytes held for 24 grammars compiled, 2 kept (each <= {max(sizes)})"
    finally:
        compiler.close()


def test_compiled_grammars_are_kept_within_a_byte_bound_least_recently_used_out(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache was bounded by entries alone: 1,024 grammars of ~3-6 MB each with a 49k
    vocabulary (a 150- to 1,000-property schema), so distinct schemas (each agent session's
    tools) could hold gigabytes in every worker and gateway. It now also holds at most
    CACHE_BYTES, dropping the least recently used; a grammar used again stays."""
    from pdserve.workers import grammar as grammar_module
    from pdserve.workers.grammar import GrammarCompiler

    def spec(i: int) -> StructuredOutputs:
        return StructuredOutputs(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                       "required": [f"k{i}"]})

    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.runner.vocab_size, (0,))
    try:
        size = compiler.compile(spec(0)).memory_size_bytes
        monkeypatch.setattr(grammar_module, "CACHE_BYTES", 3 * size + size // 2)  # room for three
        hot = compiler.compile(spec(0))
        for i in range(1, 12):
            compiler.compile(spec(i))
            assert compiler.compile(spec(0)) is hot  # used after each: never the least recent
        assert compiler.cache_bytes <= grammar_module.CACHE_BYTES
        assert len(compiler._cache) == 3 and spec(0).key() in compiler._cache
        assert compiler.cache_bytes == sum(compiler._cache[k].result().memory_size_bytes for k in compiler._cache)
    finally:
        compiler.close()
