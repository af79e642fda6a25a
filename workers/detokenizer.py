"""Incremental detokenization and stop-string matching for one request.

`tokenizers.DecodeStream` does the hard part (multi-byte characters split over
tokens, leading-space rules): seeded with the prompt's last tokens, it yields
only the new text of each generated token.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Enough prompt context for decoders whose output depends on the previous token
# (SentencePiece leading spaces); more costs time for nothing.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_ids[-_CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def add(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append a token's text; return the stop string it completed, if any
        (the text is then cut at the stop string). `match_stop=False` (before
        min_tokens is reached) appends without matching."""
        chunk = self.stream.step(self.tokenizer, token_id)
        if not chunk:
            return None
        old_len = len(self.text)
        self.text += chunk
        if not self.stop or not match_stop:
            return None
        # A stop string may straddle the old text and the new chunk.
        search_from = max(0, old_len - self.max_stop_len + 1)
        hits = [(idx + len(s), idx, s) for s in self.stop if (idx := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        # One chunk may complete several: the one that ends first stops generation
        # (as if decoded a character at a time), so no stop string stays in the text.
        end, idx, s = min(hits)
        self.text = self.text[:end] if self.include_stop else self.text[:idx]
        return s
