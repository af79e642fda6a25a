"""The text users see (incremental detokenization, stop strings, streamed text) past the happy
path. Each test states vLLM's rule it checks; each failed before its fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from factories import llama2_tokenizer, tiny_spec
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pdserve import LLM, SamplingParams
from pdserve.workers.detokenizer import IncrementalDetokenizer, _context
from pdserve.workers.sampling_params import RequestOutputKind
from pdserve.workers.tiny.builder import TinyModelSpec, init_model, save_model_dir
from pdserve.workers.tiny.tokenizer import train_tokenizer

SPEC = tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
NEVER = "\x00" * 12  # a long stop string that never occurs: widens the hold-back / search window


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(SPEC)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256, progress=False)


def prompt_of(seed: int, n: int = 12) -> list[int]:
    return torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def texts_per_token(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    """The output text after each token, as the engine's DecodeStream makes it."""
    d = IncrementalDetokenizer(tok, prompt, [], False, True)
    out = []
    for t in ids:
        d.add(t)
        out.append(d.text)
    return out


def vllm_stop(tok: Tokenizer, prompt: list[int], ids: list[int], stop: list[str], include: bool,
              min_tokens: int) -> tuple[str, str, str | None, int]:
    """vLLM v1's BaseIncrementalDetokenizer.update + check_stop_strings over the same DecodeStream:
    stop strings are checked only once len(output) > min_tokens, and a stop string must end in the
    new text (its search starts len(stop) - 1 characters before it). Among several, the earliest."""
    ds = DecodeStream(ids=_context(tok, prompt, True), skip_special_tokens=True)
    text = ""
    for k, t in enumerate(ids, 1):
        offset = len(text)
        text += ds.step(tok, t) or ""
        if k <= min_tokens:
            continue
        hits = [(i + len(s), i, s) for s in stop if (i := text.find(s, max(0, offset - len(s) + 1))) >= 0]
        if hits:
            end, i, s = min(hits)
            return (text[:end] if include else text[:i]), "stop", s, k
    return text, "length", None, len(ids)


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


# -- A: min_tokens is off by one for stop strings ----------------------------------------


def test_a_stop_string_completed_by_the_min_tokens_th_token_does_not_stop(llm: LLM) -> None:
    """vLLM (v1 detokenizer: `if self.stop and len(self.output_token_ids) > self.min_tokens`) checks
    stop strings from token min_tokens + 1 on, as min_tokens bans stop tokens up to there. pdserve's
    `token_append.append_token` matches them from token min_tokens itself
    (`may_stop = num_output_tokens >= min_tokens`)."""
    tok = llm.tokenizer.backend_tokenizer
    for seed in range(20):
        prompt = prompt_of(seed)
        ids = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        texts = texts_per_token(tok, prompt, ids)
        for n in range(2, len(ids) - 1):
            if len(texts[n - 1]) > len(texts[n - 2]) >= 2:
                stop = texts[n - 1][-2:]
                if texts[n - 1].find(stop) == len(texts[n - 1]) - 2:  # first completed by token n
                    break
        else:
            continue
        params = dataclasses.replace(GREEDY, stop=[stop], min_tokens=n)
        out = llm.generate([prompt], params)[0].outputs[0]
        want = vllm_stop(tok, prompt, ids, [stop], False, n)
        assert want[3] != n  # vLLM does not stop at token n
        assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == want
        return
    pytest.skip("no suitable output")


# -- B: a stop string that ended before matching was on is found later ----------------------


def test_a_stop_string_completed_while_matching_was_off_is_not_found_later() -> None:
    """vLLM's check_stop_strings finds a stop string only where it overlaps the new text (its search
    starts len(stop) - 1 characters back); `IncrementalDetokenizer.add` searches max_stop_len - 1
    back for every stop string, so a short one completed before min_tokens (match_stop=False) is
    found by a later token that adds nothing to it."""
    tok = train_tokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("Say:").ids, ["ab", NEVER], True, skip_special_tokens=True)
    for t in tok.encode("ab cd").ids:
        assert d.add(t, match_stop=False) is None
    streamed = d.text
    assert d.add(tok.encode(" e").ids[0], match_stop=True) is None
    assert d.text.startswith(streamed)  # with include_stop_str_in_output nothing is held back: sent already


def test_streamed_text_is_never_taken_back_by_a_stop_string_found_after_min_tokens(llm: LLM) -> None:
    """The engine-level effect of B with include_stop_str_in_output: the deltas streamed before
    min_tokens carry text past the stop string, the final output is cut before it; the
    concatenated stream is no longer the final text (and vLLM would not have stopped)."""
    tok = llm.tokenizer.backend_tokenizer
    for seed in range(20):
        prompt = prompt_of(seed)
        ids = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        texts = texts_per_token(tok, prompt, ids)
        n = 12
        before = texts[n - 2]  # the text after token n - 1
        if len(before) < 6:
            continue
        stop = before[-5:-3]  # ends 3 characters before that text ends: within max_stop_len - 1 of it
        if before.find(stop) != len(before) - 5 or stop in "".join(texts[-1][len(before) - 4:]):
            continue
        params = dataclasses.replace(GREEDY, stop=[stop, NEVER], include_stop_str_in_output=True, min_tokens=n)
        final = llm.generate([prompt], params)[0].outputs[0]
        eng = llm.engine
        eng.add_request("delta", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
        streamed = ""
        while eng.has_unfinished_requests():
            streamed += "".join(o.outputs[0].text for o in eng.step())
        assert streamed == final.text, "a delta already sent was taken back"
        assert vllm_stop(tok, prompt, ids, [stop, NEVER], True, n)[1:] == (final.finish_reason, final.stop_reason,
                                                                           len(final.token_ids))
        return
    pytest.skip("no suitable output")


# -- C: CUMULATIVE outputs show text a stop string later cuts ---------------------------------


def test_cumulative_outputs_never_show_text_a_stop_string_cuts_later(llm: LLM) -> None:
    """vLLM's get_next_output_text(finished, delta=False) holds back the last max_stop_len - 1
    characters of a running request's cumulative text too; `token_append.request_output` holds back only
    for DELTA, so a CUMULATIVE output (the default output_kind) shows the start of a stop string
    that the next output removes."""
    tok = llm.tokenizer.backend_tokenizer
    prompt = prompt_of(3)
    ids = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    texts = texts_per_token(tok, prompt, ids)
    full = texts[-1]
    # a stop string straddling two tokens' text, first at that place
    k = next(k for k in range(3, len(ids)) if len(texts[k - 1]) >= 3 and len(texts[k]) > len(texts[k - 1]))
    stop = texts[k - 1][-2:] + texts[k][len(texts[k - 1])]
    assert full.find(stop) == len(texts[k - 1]) - 2
    eng = llm.engine
    eng.add_request("cum", prompt, dataclasses.replace(GREEDY, stop=[stop]))  # CUMULATIVE: the default
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.outputs[0].text for o in eng.step()]
    assert seen[-1] == full[: full.find(stop)]
    for earlier in seen:
        assert seen[-1].startswith(earlier), f"{earlier[-8:]!r} was shown, then taken back"


# -- D: SentencePiece byte-fallback: DecodeStream raises and the request fails ---------------


def test_a_newline_then_an_unfinished_character_does_not_break_the_detokenizer() -> None:
    """Llama 2 / Mistral: "\\n" (<0x0A>), then the first byte of a character the model never
    finishes, then a word. ByteFallback decodes the byte run [0A, E4] as two U+FFFD, so the text
    DecodeStream gave out ("\\n") is no longer a prefix and `DecodeStream.step` raises "Invalid
    prefix encountered"; `IncrementalDetokenizer.add` lets it through and the engine fails the
    request. vLLM's FastIncrementalDetokenizer._protected_step catches it and resets the stream."""
    tok = llama2_tokenizer()
    out = [tok.token_to_id("<0x0A>"), tok.token_to_id("<0xE4>"), tok.token_to_id("▁ok")]
    d = IncrementalDetokenizer(tok, tok.encode("Hello").ids, [], False, skip_special_tokens=True)
    for t in out:
        d.add(t)  # raised "Invalid prefix encountered"
    assert d.text.startswith("\n")


@pytest.mark.parametrize(("bytes_", "word"), [(["<0xE4>"], "▁ok"), (["<0xA5>", "<0x11>"], "▁the")])
def test_the_stream_started_again_keeps_the_held_bytes_and_the_next_words_space(bytes_: list[str], word: str) -> None:
    """After that reset, the text goes on as tokenizer.decode reads what the old stream held and
    the word that broke it: one U+FFFD per held byte, then " ok". A fresh stream dropped the held
    bytes and, its first token's leading space stripped (Llama 2's Strip decoder), glued the word
    to the text before it ("\\nok")."""
    tok = llama2_tokenizer()
    held, last = [tok.token_to_id(b) for b in bytes_], tok.token_to_id(word)
    d = IncrementalDetokenizer(tok, tok.encode("Hello").ids, [], False, skip_special_tokens=True)
    for t in [tok.token_to_id("<0x0A>"), *held, last]:
        d.add(t)
    assert d.text == "\n" + tok.decode([*held, last])
    assert d.text == "\n" + "\ufffd" * len(held) + word.replace("▁", " ")


def test_requests_over_a_byte_fallback_tokenizer_are_not_failed_by_the_detokenizer(tmp_path: Path) -> None:
    """The engine-level effect: sampled requests over a Llama 2-style tokenizer end "abort"
    with the DecodeStream's error whenever the model emits an invalid byte sequence."""
    tok = llama2_tokenizer()
    save_model_dir(init_model(SPEC, tok), tok, tmp_path, False)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, num_kv_blocks=64, progress=False)
    outs = llm.generate(["Answer:"], SamplingParams(temperature=1.0, seed=0, n=8, max_tokens=24, ignore_eos=True))
    reasons = [c.finish_reason for c in outs[0].outputs]
    assert reasons == ["length"] * 8


# -- E: the final text drops a last, unfinished character --------------------------------------


def test_the_final_text_of_a_request_cut_inside_a_character_is_its_decode(llm: LLM) -> None:
    """The oracle: the final text (and the streamed deltas) equal tokenizer.decode(output ids).
    A request that max_tokens cuts inside a multi-byte character ends with text DecodeStream held
    back (it waits for the character's other bytes) and never gives out: decode shows U+FFFD."""
    tok = llm.tokenizer.backend_tokenizer
    for seed in range(40):
        prompt = prompt_of(seed)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        ids = llm.generate([prompt], params)[0].outputs[0].token_ids
        cut = next((k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")
                    and not tok.decode(ids[: k - 1]).endswith("\ufffd")), None)
        if cut is None:
            continue
        out = llm.generate([prompt], dataclasses.replace(params, max_tokens=cut))[0].outputs[0]
        assert out.token_ids == ids[:cut] and out.finish_reason == "length"
        assert out.text == tok.decode(ids[:cut])
        return
    pytest.skip("no output cut inside a character")


def test_a_prefill_workers_first_token_cut_inside_a_character_leaves_it_to_the_decode_worker(llm: LLM) -> None:
    """A handed-off request's share on the prefill worker ends at its first token (max_tokens 1,
    `hold_kv`): that end is not the request's, so a character the first token begins is not
    flushed as U+FFFD there (the decode worker completes it). Flushed, the served text gained a
    character (chaos (a): 565 characters for 564). A request that does end there gets it."""
    tok = llm.tokenizer.backend_tokenizer
    partial = next(t for t in range(tok.get_vocab_size()) if tok.decode([t]) == "\ufffd")
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={partial: 100.0})
    eng = llm.engine
    for rid, hold in (("held", True), ("ends", False)):
        eng.add_request(rid, prompt_of(3), params, hold_kv=hold)
    texts: dict[str, str] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                assert out.outputs[0].token_ids == [partial]
                texts[out.request_id] = out.outputs[0].text
    eng.release("held")
    assert texts == {"held": "", "ends": "\ufffd"}


# -- logprobs' bytes: a token's own, not its text's ------------------------------------------------

MULTIBYTE = "naïve café: 世界, 🎉 and ∑ over ℝ"


def test_a_tokens_bytes_are_what_it_adds_to_the_text_on_a_byte_level_tokenizer(model_dir: Path) -> None:
    """OpenAI's chat logprobs give each token's `bytes` so that characters split over tokens can be
    rebuilt; they were the UTF-8 of the token's decoded text, which is U+FFFD for a part of a
    character. Joined in order, the tokens' bytes are the text's UTF-8 (the oracle)."""
    from transformers import AutoTokenizer

    from pdserve.cluster.token_text import TokenText, decoder_kind

    tok = AutoTokenizer.from_pretrained(model_dir)
    text_of = TokenText(tok)
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert decoder_kind(tok) == "byte_level"
    assert b"".join(bytes(text_of.utf8(t)) for t in ids) == MULTIBYTE.encode("utf-8")
    split = [t for t in ids if "\ufffd" in text_of(t)]
    assert split and all(bytes(text_of.utf8(t)) != text_of(t).encode("utf-8") for t in split)


def test_a_tokens_bytes_on_a_byte_fallback_tokenizer() -> None:
    """Llama 2 / Mistral: `<0xNN>` pieces are the byte NN, "▁" a space (the leading one too, which
    the decoder strips from the text)."""
    from transformers import PreTrainedTokenizerFast

    from pdserve.cluster.token_text import TokenText, decoder_kind

    tok = PreTrainedTokenizerFast(tokenizer_object=llama2_tokenizer())
    text_of = TokenText(tok)
    text = "Hello 世界 ok 🎉"
    ids = tok.encode(text, add_special_tokens=False)
    assert decoder_kind(tok) == "byte_fallback"
    assert b"".join(bytes(text_of.utf8(t)) for t in ids) == (" " + text).encode("utf-8")


# -- F: a stop token's own text is searched for stop strings ----------------------------------


def test_a_stop_tokens_text_kept_by_include_stop_str_is_not_cut_by_a_stop_string(llm: LLM) -> None:
    """vLLM (v1 BaseIncrementalDetokenizer.update: "Stop token triggered; skip stop string check")
    ends on a stop token with its text whole under include_stop_str_in_output, stop_reason the
    token. pdserve searched that text for stop strings too and cut it at one, while still
    reporting the token: stop ["y"] and stop token "sys" gave "sy". Here the stop string is the
    token's first character."""
    tok = llm.tokenizer.backend_tokenizer
    for seed in range(20):
        prompt = prompt_of(seed)
        first = llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=1))[0].outputs[0]
        token, text = first.token_ids[0], first.text
        if len(text) < 2:
            continue
        params = dataclasses.replace(GREEDY, stop=[text[0]], stop_token_ids=[token], include_stop_str_in_output=True)
        out = llm.generate([prompt], params)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", token)
        assert out.text == tok.decode([token]) == text
        return
    pytest.skip("no first token of two characters")
