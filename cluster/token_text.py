"""One token's text and bytes, as the API's logprobs report them.

OpenAI's chat logprobs give each token's `bytes` so that a client can rebuild characters that
several tokens share (a CJK character or an emoji is often two or three byte-level tokens). The
bytes of a token's decoded text cannot say that: a token holding part of a character decodes to
U+FFFD, whose bytes are [239, 191, 189] whatever the token held. So the bytes come from the
vocabulary itself, by the tokenizer's kind (read from its decoder):

- byte-level BPE (GPT-2's mapping: Llama 3, Qwen2, SmolLM2, this project's tiny models): each
  character of the token's piece stands for one byte;
- SentencePiece-style byte fallback (Llama 2, Mistral): `<0xNN>` is the byte NN, "▁" a space;
- anything else: the UTF-8 of the token's decoded text (as before).
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed: the printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


def decoder_kind(tokenizer: Any) -> str:
    """"byte_level", "byte_fallback" or "text", from a transformers tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return "text"
    kinds = {d.get("type") for d in [decoder, *decoder.get("decoders", [])] if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    return "text"


class TokenIdText:
    """vLLM's `return_tokens_as_token_ids`: a token named `token_id:<id>` in logprobs (so that
    a token whose text is not valid UTF-8 alone is still told apart), its bytes those of that name."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def utf8(self, token_id: int) -> list[int]:
        return list(self(token_id).encode())


class TokenText:
    """A tokenizer's single tokens: `token(id)` their text (what logprobs name them by) and
    `utf8(id)` the bytes they add to the output. Both cached: a vocabulary is bounded."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._kind: str | None = None  # read on first use: a gateway without logprobs never needs it
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def utf8(self, token_id: int) -> list[int]:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._raw(token_id)
        return got

    def _raw(self, token_id: int) -> list[int]:
        if self._kind is None:
            self._kind = decoder_kind(self.tokenizer)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._kind == "byte_level" and all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
            if self._kind == "byte_fallback":
                byte = _BYTE_PIECE.fullmatch(piece)
                return [int(byte.group(1), 16)] if byte else list(piece.replace("▁", " ").encode("utf-8"))
        return list(self(token_id).encode("utf-8", errors="replace"))
