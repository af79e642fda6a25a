"""Incremental detokenization and stop strings, with the tiny byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pdserve.workers.detokenizer import IncrementalDetokenizer
from pdserve.workers.tiny.tokenizer import train_tokenizer

PROMPT = "Prompt: say something."
TEXTS = [
    "héllo ✓ 你好 🙂",
    "Hello world. STOP here",
    "  two spaces, tabs\tand\nnewlines; ünïcödé ×÷ ∑ 日本語のテキスト 🙂🙃 done",
]


@pytest.fixture(scope="module")
def tok(session_cache: Path) -> Tokenizer:
    return train_tokenizer()


def detok(tok: Tokenizer, stop: tuple[str, ...] | list[str] = (), include_stop: bool = False,
          prompt: str = PROMPT) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt).ids, list(stop), include_stop, skip_special_tokens=True)


def feed(d: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    """Add tokens until one completes a stop string: (that string, its token index), else (None, len)."""
    for i, t in enumerate(ids):
        found = d.add(t)
        if found is not None:
            return found, i
    return None, len(ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", [PROMPT, "x", "日本"])
def test_one_token_at_a_time_reproduces_decode(tok: Tokenizer, text: str, prompt: str) -> None:
    ids = tok.encode(text).ids
    d = detok(tok, prompt=prompt)
    for i, t in enumerate(ids):
        assert d.add(t) is None
        assert "\ufffd" not in d.text, "a split multi-byte character leaked a replacement char"
        assert tok.decode(ids).startswith(d.text)
        assert len(d.text) >= len(tok.decode(ids[: i + 1]).rstrip("\ufffd"))
    assert d.text == tok.decode(ids) == text


@pytest.mark.parametrize("prompt_end", ["cut", "literal"], ids=["ids-cut-inside-a-character", "literal-U+FFFD"])
@pytest.mark.parametrize("text", [" ok then", "🙂 and more"])
def test_a_prompt_ending_in_an_unfinished_character_stays_out_of_the_text(tok: Tokenizer, prompt_end: str,
                                                                          text: str) -> None:
    """A prompt whose text ends in U+FFFD (token ids cut inside a character, or a literal one):
    DecodeStream took the context for a character still to be completed and handed the whole
    context's text out with the first generated token ('ay hi \ufffd ok then' for ' ok then')."""
    emoji = tok.encode("🙂").ids
    assert len(emoji) > 1
    prompt = (tok.encode("Say hi ").ids + emoji[:-1] if prompt_end == "cut"
              else tok.encode("Fix this byte: \ufffd").ids)
    assert tok.decode(prompt).endswith("\ufffd")
    gen = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, prompt, [], False, skip_special_tokens=True)
    feed(d, gen)
    assert d.text == tok.decode(gen) == text


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    """Guard for the test above: the tokenizer really splits these characters."""
    ids = tok.encode(TEXTS[0]).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<|end_of_text|>")
    ids = tok.encode("ab").ids + [eos] + tok.encode(" cd").ids
    d = detok(tok)
    feed(d, ids)
    assert d.text == tok.decode(ids) == "ab cd"


def single_token_texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([t]) for t in ids]


@pytest.mark.parametrize(
    ("stop", "before"),
    [("orld", "Hello w"), ("lo world", "Hel"), ("d. ST", "Hello worl"), ("STOP", "Hello world. ")],
)
@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_across_tokens(tok: Tokenizer, stop: str, before: str, include_stop: bool) -> None:
    text = "Hello world. STOP here"
    ids = tok.encode(text).ids
    if stop != "STOP":  # the others straddle token boundaries
        assert not any(stop in piece for piece in single_token_texts(tok, ids))

    d = detok(tok, stop=["never", stop], include_stop=include_stop)
    found, at = feed(d, ids)

    assert found == stop
    # It fires on the token that completes the stop string, not later.
    assert stop in tok.decode(ids[: at + 1]) and stop not in tok.decode(ids[:at])
    assert d.text == (before + stop if include_stop else before)


def test_stop_string_of_split_multibyte_characters(tok: Tokenizer) -> None:
    ids = tok.encode("héllo ✓ 你好 🙂").ids
    d = detok(tok, stop=["✓ 你"])
    assert feed(d, ids)[0] == "✓ 你"
    assert d.text == "héllo "


def test_stop_string_in_the_prompt_does_not_fire(tok: Tokenizer) -> None:
    d = detok(tok, stop=["say"], prompt="please say")
    assert feed(d, tok.encode(" something").ids) == (None, 2)
    assert d.text == " something"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    """When one token completes several stop strings, the one that ends first stops,
    whatever their order in the list: no stop string is left in the text."""
    wor = tok.token_to_id("Ġwor")
    assert wor is not None
    d = detok(tok, stop=["or", "w"])  # one token, " wor", holds both
    assert d.add(wor) == "w" and d.text == " "
    d = detok(tok, stop=["or", "w"], include_stop=True)
    assert d.add(wor) == "w" and d.text == " w"
    d = detok(tok, stop=["wor", "or"])  # both end with the chunk: cut at the one starting first
    assert d.add(wor) == "wor" and d.text == " "
