"""The cheapest length check a text prompt can get: its characters, before it is tokenized.

A tokenizer that keeps every character of its input (byte-level BPE, SentencePiece
with byte fallback: what decoder LLMs ship) covers each character with some token,
and one token stands for at most as many characters as its vocabulary string has
(a byte-level token's string has one character per byte, a byte-fallback token's
"<0x0A>" six for one byte). So a prompt of c characters makes at least
c / longest tokens, where `longest` is the longest string in the vocabulary; one
of more than longest * (max_model_len - 1) characters cannot leave room to
generate, whatever it says. `len(str)` costs nothing: a 15 MiB prompt is refused
without the tokenizer seeing it, with the 400 a tokenized too-long prompt gets.

A tokenizer may also fold characters before it cuts the text: NFC or NFKC (Qwen2's
normalizer) composes at most `MAX_COMPOSITION` characters into one, so the bound
is that much wider then. Anything else that drops or folds characters (runs of
spaces collapsed, accents stripped, unknown characters fused into one <unk>) has
no such bound: `char_bound` finds out by a round trip of a probe holding those
characters, and for such a tokenizer returns None (the gateway then tokenizes to
measure, in the tokenizer pool's long lane).
"""

from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.limits import RefusalReason, Refused
from pdserve.workers.inputs import ContextOverflowError

log = logging.getLogger(__name__)

# The most characters canonical composition (NFC, NFKC) turns into one: the longest
# canonical decomposition of a code point (U+1F82: alpha with three marks).
# tests/cluster/test_tokenize_bound.py checks it against unicodedata.
MAX_COMPOSITION = 4

# What lossy tokenizers drop or fold: runs of whitespace, combining marks, Hangul
# jamo, compatibility forms, controls, zero-width joiners, private-use characters
# (no vocabulary has them: byte-level or byte-fallback, or an <unk>), then ordinary
# text. It starts with a letter: SentencePiece decoders strip the space they prepend.
_PROBE = ("a" + " " * 40 + "b\t\t\tc\n\n\r\n d" + "e\u0301 \u1100\u1161\u11a8 \uff8a\uff9f \ufb01 \u00a0\u00a0"
          " \x00\x01\x1f\x7f \u200b\u200d\u2060 \ue000\U000f0000 \u0301\u0301\u0301 \U0001f469\u200d\U0001f4bb"
          " \u65e5\u672c\u8a9e \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 x=[1, 2];  # end")


class TextTooLong(Refused, ContextOverflowError):
    """A text more characters long than the context can hold in tokens."""


@dataclass(frozen=True)
class CharBound:
    """At most `chars_per_token` characters per token: a text of more than
    `max_chars` characters cannot fit `max_model_len` with room to generate."""

    chars_per_token: int
    max_model_len: int

    @property
    def max_chars(self) -> int:
        return self.chars_per_token * (self.max_model_len - 1)

    def check(self, param: str, chars: int) -> None:
        """Refused (a 400 naming `param`) when `chars` characters are surely too long."""
        if chars > self.max_chars:
            # MALFORMED, as the same refusal after tokenizing (workers/inputs.py max_new_tokens).
            raise TextTooLong(param, f"this model's maximum context length is {self.max_model_len} tokens; "
                                 f"the {param} has {chars} characters, more than {self.max_model_len - 1} "
                                 f"tokens can hold (one token is at most {self.chars_per_token} characters "
                                 "with this tokenizer)", RefusalReason.MALFORMED)


def char_bound(tokenizer: Any, max_model_len: int) -> CharBound | None:
    """The bound for `tokenizer` (an HF tokenizer), or None when it has none (it drops
    or folds characters beyond what composition does, or it is not an HF tokenizer)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()))
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception as e:  # noqa: BLE001 - no bound is the safe answer; say why once
        log.info("no prompt length bound before tokenizing: the tokenizer could not be probed (%r)", e)
        return None
    if back == _PROBE:
        return CharBound(longest, max_model_len)
    if back in (unicodedata.normalize("NFC", _PROBE), unicodedata.normalize("NFKC", _PROBE)):
        return CharBound(longest * MAX_COMPOSITION, max_model_len)
    log.info("no prompt length bound before tokenizing: the tokenizer does not keep every character "
             "(prompts are measured by tokenizing them)")
    return None
