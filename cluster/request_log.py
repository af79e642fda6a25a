"""vLLM's request log: a line per request as the gateway starts it (`--enable-log-requests`) and
one per answer as it ends (`--enable-log-outputs`), prompts and outputs cut to `--max-log-len`.

Why: debugging a client's complaint starts from what the server was asked and what it answered;
vLLM users turn this on with those flags and read it in the server's log. Off by default: prompts
are users' data, and a line per request costs the gateway CPU.

The lines (logger `pdserve.requests`, INFO; the gateway replica's stderr, which `pdserve serve`
shows on its console):
    Received request cmpl-...: prompt: '...', params: SamplingParams(...), prompt_token_ids: [...]
    Generated response cmpl-...: output: '...', output_token_ids: [...], finish_reason: stop
A request with several prompts names each (`cmpl-... prompt 1`), and one with several answers (prompts
or samples, n) each answer by its choice index (`cmpl-... choice 3`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.workers.info_log import info_logger
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams

LOGGER = "pdserve.requests"


class _Prompt(Protocol):
    prompt_ids: list[int]
    params: SamplingParams
    prompt_only: bool


@dataclass
class _Answer:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class RequestLog:
    """What one gateway logs of its requests (nothing when neither is on)."""

    def __init__(self, tokenizer: Any, requests: bool = False, outputs: bool = False,
                 max_len: int | None = None) -> None:
        if max_len is not None and max_len < 0:
            raise ValueError(f"max_log_len: {max_len} must be at least 0")
        self.tokenizer, self.requests, self.outputs, self.max_len = tokenizer, requests, outputs, max_len
        self._log = info_logger(LOGGER) if requests or outputs else None

    def received(self, rid: str, works: Sequence[_Prompt]) -> None:
        """One line per prompt of the request (`--enable-log-requests`)."""
        if not self.requests or self._log is None:
            return
        for p, work in enumerate(works):
            name = rid if len(works) == 1 else f"{rid} prompt {p}"
            ids = self._cut(work.prompt_ids)
            prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
            self._log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                           name, self._cut(prompt), work.params, ids)

    def answers(self, rid: str, works: Sequence[_Prompt]) -> Answers | None:
        """What collects request `rid`'s answers (choice p * n + j: prompt p's sample j) for their
        lines (`--enable-log-outputs`), or None."""
        if not self.outputs or self._log is None:
            return None
        return Answers(self, rid, [w.prompt_only for w in works for _ in range(w.params.n)])

    def answered(self, name: str, answer: _Answer, finish_reason: str | None) -> None:
        assert self._log is not None
        self._log.info("Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s",
                       name, self._cut("".join(answer.text)), self._cut(answer.token_ids), finish_reason)

    def _cut(self, seq: Any) -> Any:
        return seq if self.max_len is None else seq[:self.max_len]


class Answers:
    """A request's choices as their deltas come (`add`); each is logged when its final delta comes."""

    def __init__(self, log: RequestLog, rid: str, dropped: list[bool]) -> None:
        """`dropped[i]`: choice i's tokens are not its answer (echo with max_tokens 0: the prompt
        alone, the one token sampled dropped); it is logged as the empty answer the client got."""
        self._log, self._rid, self._dropped = log, rid, dropped
        self._choices: dict[int, _Answer] = {}

    def add(self, choice: int, out: RequestOutput) -> None:
        c = out.outputs[0]
        answer = self._choices.setdefault(choice, _Answer())
        if not self._dropped[choice]:
            answer.text.append(c.text)
            answer.token_ids += c.token_ids
        if out.finished:
            name = self._rid if len(self._dropped) == 1 else f"{self._rid} choice {choice}"
            self._log.answered(name, self._choices.pop(choice), c.finish_reason)
