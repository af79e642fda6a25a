"""Text prompts that re-tokenize to exactly the workload's lengths and sharing.

Only used with `--tokenizer` (the chat endpoint needs text; completions can take
token ids). Decoding random ids and encoding the text again rarely gives the
same count (merges, invalid UTF-8 pieces), so each segment is grown or cut
until `encode(text so far + segment text)` is the earlier tokens unchanged plus
exactly the segment's length. Text is built per chain of keyed segments and
cached, so requests that share a key chain share its text and therefore its
tokens: prefix sharing survives tokenization.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .workloads import BenchRequest

_TRIES = 20  # fresh random starts per segment before giving up
_ADJUST = 12  # grow/cut steps per start


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class TextRenderer:
    def __init__(self, tokenizer: Tokenizer, token_ids: list[int], seed: int) -> None:
        """`token_ids`: the ids random text is decoded from (no special tokens)."""
        if not token_ids:
            raise ValueError("tokenizer: no usable token ids")
        self.tok = tokenizer
        self.pool = np.asarray(token_ids)
        self.rng = np.random.default_rng(seed)
        # key chain -> (text, its ids); () is the empty prompt
        self._chains: dict[tuple[str, ...], tuple[str, list[int]]] = {(): ("", [])}

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def render(self, req: BenchRequest) -> str:
        text, ids = "", list[int]()
        chain: tuple[str, ...] | None = ()
        for seg in req.segments:
            if chain is not None and seg.key is not None and (*chain, seg.key) in self._chains:
                chain = (*chain, seg.key)
                text, ids = self._chains[chain]
                continue
            text, ids = self._extend(text, ids, len(seg.token_ids), seg.token_ids)
            if chain is not None and seg.key is not None:
                chain = (*chain, seg.key)
                self._chains[chain] = (text, ids)
            else:
                chain = None  # after a request's own tokens nothing is shared
        return text

    def _extend(self, text: str, ids: list[int], n: int, start: tuple[int, ...]) -> tuple[str, list[int]]:
        """text + more, whose encoding is `ids` followed by exactly n new tokens."""
        cand = [int(t) for t in start]
        for _ in range(_TRIES):
            for _ in range(_ADJUST):
                piece = self.tok.decode(cand)
                if text and not piece[:1].isspace():
                    piece = " " + piece  # a word boundary keeps BPE from merging across the join
                new = self.encode(text + piece)
                if new[:len(ids)] != ids:
                    break  # the join changed earlier tokens: start again
                extra = len(new) - len(ids) - n
                if extra == 0:
                    return text + piece, new
                if extra > 0:
                    cand = cand[:len(cand) - extra]
                    if not cand:
                        break
                else:
                    cand = cand + self._draw(-extra)
            cand = self._draw(n)
        raise ValueError(f"tokenizer: could not make text of exactly {n} tokens after {len(ids)} "
                         f"(tried {_TRIES} random starts); send token ids instead (omit --tokenizer)")

    def _draw(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.choice(self.pool, size=n)]


def usable_token_ids(tokenizer: object) -> list[int]:
    """Every id of the vocabulary but the special ones (BOS/EOS/chat markers)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    size = len(tokenizer)  # type: ignore[arg-type]
    return [i for i in range(size) if i not in special]


def load_tokenizer(path: str) -> Tokenizer:
    from transformers import AutoTokenizer  # heavy: only when --tokenizer is given

    try:
        return AutoTokenizer.from_pretrained(path)  # type: ignore[no-any-return]
    except OSError as e:  # not there, or no tokenizer in it: transformers' traceback out of `pdserve bench`
        raise ValueError(f"tokenizer: cannot load {path}: {str(e).splitlines()[0] if str(e) else e!r}") from None
