"""Incremental detokenization and stop-string matching for one request.

`tokenizers.DecodeStream` does the hard part (multi-byte characters split over
tokens, leading-space rules): seeded with the prompt's last tokens, it yields
only the new text of each generated token.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

# Enough prompt context for decoders whose output depends on the previous token
# (SentencePiece leading spaces); more costs time for nothing.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=_context(tokenizer, prompt_ids, skip_special_tokens),
                                   skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self._pending: list[int] = []  # tokens whose text the stream holds (a character not yet whole)

    def add(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append a token's text; return the stop string it completed, if any
        (the text is then cut at the stop string). `match_stop=False` (min_tokens
        not passed yet) appends without matching."""
        chunk = self._step(token_id)
        if not chunk:
            self._pending.append(token_id)
            return None
        self._pending.clear()
        old_len = len(self.text)
        self.text += chunk
        if not self.stop or not match_stop:
            return None
        # A stop string may straddle the old text and the new chunk, but must end in the chunk: one
        # completed before (while matching was off: min_tokens) is not found by a later token.
        hits = [(idx + len(s), idx, s) for s in self.stop
                if (idx := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0]
        if not hits:
            return None
        # One chunk may complete several: the one that ends first stops generation
        # (as if decoded a character at a time), so no stop string stays in the text.
        end, idx, s = min(hits)
        self.text = self.text[:end] if self.include_stop else self.text[:idx]
        return s

    def finish(self) -> None:
        """The request ended (not on a stop string): the text of tokens still held for a
        character never completed (max_tokens or a stop token cut inside it) goes out as the
        tokenizer decodes it (U+FFFD), so the text is the decode of the output's tokens."""
        if self._pending:
            self.text += self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
            self._pending.clear()

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception for it
            if "Invalid prefix" not in str(e):
                raise
            # A byte-fallback run (SentencePiece <0xNN> tokens: Llama 2, Mistral) that a later byte made
            # decode otherwise ("\n" then an unfinished character: two U+FFFD): DecodeStream cannot go
            # on. A new stream, the text so far kept (vLLM's recovery), seeded with the tokens the
            # old one held: its first text is then their decode and this token's (U+FFFD per byte
            # left unfinished, and the token's leading space, which a stream's first token loses).
            log.info("detokenizer: a byte run decoded differently with token %d; the stream starts again", token_id)
            self.stream = DecodeStream(ids=list(self._pending), skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.tokenizer, token_id)


def _context(tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last tokens to seed a DecodeStream with, ending where their text does not end
    in U+FFFD. DecodeStream takes a context whose text ends so for a character still to be
    completed, and hands the whole context's text out with the first generated token: a prompt
    of token ids cut inside a character (random or truncated prompts, byte-level vocabularies),
    or a text prompt ending in a literal U+FFFD, began its completion with the prompt's tail.
    Such trailing tokens are left out (no context at all where nothing else is left)."""
    end = len(prompt_ids)
    while end > 0 and len(prompt_ids) - end < _CONTEXT_TOKENS:
        ids = prompt_ids[max(0, end - _CONTEXT_TOKENS):end]
        if not tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return ids
        end -= 1
    return []
