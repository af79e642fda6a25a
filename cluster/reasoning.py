"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's thinking, written between
`<think>` and `</think>` before its answer, split out of a chat answer.

The answer's `content` is what follows `</think>`; the thinking goes in `reasoning` (vLLM's
name) and `reasoning_content` (its older one, DeepSeek's API's). vLLM's rules, the same for
both parsers pdserve has (its deepseek_r1 and qwen3, vllm/reasoning/basic_parsers.py):

- the text before the first `</think>` is the thinking, the text after it the content (none:
  null). A `<think>` that opens the output (after whitespace) is dropped: the models whose
  template leaves it out of the prompt write it themselves (Qwen3, QwQ).
- no `</think>` at all: the whole output is thinking, cut short (by max_tokens, a stop).
- qwen3 with `chat_template_kwargs` `{"enable_thinking": false}`: Qwen3's template closes the
  thinking in the prompt, so the whole output is content (vLLM's streamed answer; its whole one
  looks for a `</think>` still, which no streamed answer can take back). So is the answer to any
  prompt that ends with `</think>` (another template that closes it), or that continues an
  assistant message whose thinking is closed (`closes_thinking`); a grammar then applies from the
  first token.

An answer under a grammar (structured outputs, a required or named tool call) is parsed too:
its grammar starts after the `</think>` token (cluster/openai_app.py `_chat_works` asks the
worker for that), as vLLM's does. Where `</think>` is several tokens, the grammar applies from
the first token, the model writes no thinking, and the answer is not parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ReasoningParser = Literal["deepseek_r1", "qwen3"]
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingEnd:
    """Where an answer's thinking ends, counted in its tokens: usage's reasoning tokens."""

    tokenizer: Any
    token_id: int | None  # END's id where the vocabulary spells it as one token (DeepSeek-R1's, Qwen3's)

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkingEnd:
        try:
            ids = list(tokenizer.encode(END, add_special_tokens=False))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: found by decoding
            ids = []
        return cls(tokenizer, ids[0] if len(ids) == 1 else None)

    def tokens(self, token_ids: list[int], text: str) -> int:
        """The tokens of an answer (`token_ids`, whose text is `text`) through the end of its
        thinking, END's included; all of them while it has no END (cut short, or still going)."""
        if END not in text:
            return len(token_ids)
        if self.token_id is not None and self.token_id in token_ids:
            return token_ids.index(self.token_id) + 1
        lo, hi = 1, len(token_ids)  # END in several tokens: the fewest whose text holds it (log n decodes)
        while lo < hi:
            mid = (lo + hi) // 2
            if END in self.tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclass(frozen=True)
class ReasoningPlan:
    """How a chat request's answers are split into thinking and content."""

    include: bool = True  # the request's `include_reasoning`: false drops the thinking
    end: ThinkingEnd | None = field(default=None, compare=False)  # counts the reasoning tokens for usage

    @classmethod
    def of(cls, parser: ReasoningParser | None, template_kwargs: dict[str, object] | None, include: bool,
           end: ThinkingEnd | None = None, closed: bool = False) -> ReasoningPlan | None:
        """The plan of a request (None: its answers are not parsed). `closed`: its prompt
        ended the thinking (`closes_thinking`), so the answer is all content."""
        if parser is None or closed:
            return None
        # `is False`, as Qwen3's template tests it (`enable_thinking is false`): only then is it off
        if parser == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
            return None
        return cls(include, end)

    @staticmethod
    def split(text: str) -> tuple[str, str | None]:
        """(thinking, content) of a whole answer; content None when there is none."""
        head, tag, content = text.partition(END)
        return _drop_start(head), (content or None) if tag else None


@dataclass
class ThinkingStream:
    """One streamed answer's split, kept as the answer grows: each delta costs about its own
    length, not the answer's (a thinking model writes thousands of tokens). What it gives out is
    what more text cannot change: a tag that may still be coming (`<think>` at the start,
    `</think>` at the end) is held. At the end, the pieces add up to `ReasoningPlan.split`'s."""

    sent: int = 0  # characters of the text given out as thinking, or dropped (the start tag)
    opened: bool = False  # whether the start was judged: a `<think>` there dropped, or none
    answer: int | None = None  # where the answer after `</think>` starts in the text, once seen

    def advance(self, text: str, done: bool) -> tuple[str, int | None]:
        """The thinking of the answer so far `text` not given out before, and where its answer
        starts (None: still thinking). `done`: the answer ended; all of it is known."""
        if self.answer is not None:
            return "", self.answer
        end = text.find(END, self.sent)  # (no `</think>` starts before what was given out: it was held)
        if not self.opened and (end >= 0 or done or not START.startswith(text.lstrip())):
            lead = len(text) - len(text.lstrip())
            if text.startswith(START, lead):
                self.sent = lead + len(START)
            self.opened = True
        if not self.opened:  # only whitespace so far, or the start tag's beginning
            return "", None
        if end >= 0:
            piece, self.sent, self.answer = text[self.sent : end], end, end + len(END)
            return piece, self.answer
        stop = len(text) if done else max(self.sent, len(text) - _partial_end(text))
        piece, self.sent = text[self.sent : stop], stop
        return piece, None


def closes_thinking(prompt: str, continued: str | None) -> bool:
    """Whether a chat's rendered prompt already ended the thinking its answer would open: the
    template closed it (an empty `<think>\n\n</think>` at the end, as Qwen3's writes with
    thinking off), or the assistant message the answer continues
    (`continue_final_message`, `continued`) holds a `</think>` after its last `<think>`. Only the
    prompt's end counts: an agent loop's earlier turns keep their closed thinking (Qwen3's template
    does), and the next answer thinks again."""
    if prompt.rstrip().endswith(END):
        return True
    return continued is not None and continued.rfind(END) > continued.rfind(START)


def _drop_start(head: str) -> str:
    """The thinking without the start tag that opens it (after whitespace)."""
    lead = head.lstrip()
    return lead[len(START):] if lead.startswith(START) else head


def _partial_end(text: str) -> int:
    """How many of `text`'s last characters may be the beginning of `</think>`."""
    for k in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-k:]):
            return k
    return 0
