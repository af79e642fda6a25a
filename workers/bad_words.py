"""vLLM's `bad_words`: words whose tokens the output never holds in full.

A word is taken as the model tokenizes it alone and after a space (a word at the start of the
text and one in the middle of it tokenize apart in byte-level BPE); the spaced form counts only
where it is another token sequence of the same length, as vLLM has it. At each step, a word's
last token is banned where the output ends with the tokens before it (a one-token word: always).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_token_ids(words: Sequence[str], tokenizer: _Encoder, vocab_size: int) -> list[list[int]]:
    """Each word's token sequences (vLLM's `_get_bad_words_ids`). A ValueError for a word the
    tokenizer makes no token of. A sequence with a token beyond the model's `vocab_size` (a
    tokenizer larger than the model's embedding) cannot be generated: left out, not indexed."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} makes no token")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        forms = [plain, spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]
        out.extend(ids for ids in forms if max(ids) < vocab_size)
    return out


def banned_by_words(words: list[list[int]], output: Sequence[int]) -> list[int]:
    """The tokens `words` ban after `output` (the request's output tokens so far)."""
    banned = []
    for ids in words:
        prefix = len(ids) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == ids[:prefix]:
            banned.append(ids[-1])
    return banned
