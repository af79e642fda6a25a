"""Per-request sampling parameters, validated where they enter."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every step: all tokens and text so far
    DELTA = "delta"  # every step: only what is new (streaming)
    FINAL_ONLY = "final_only"  # once, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (the fields vLLM users know).

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those
    filters. `seed` makes a request's samples reproducible whatever else is in
    the batch. `logprobs=N` returns the N most likely tokens' log-probabilities
    (of the raw model distribution) at each step, plus the sampled token's.

    Penalties, as vLLM applies them to the logits before temperature:
    `repetition_penalty` (> 0, 1 = off) divides the positive logits and
    multiplies the negative ones of every token already in the prompt or the
    output (the CTRL / transformers definition); `presence_penalty` and
    `frequency_penalty` (in [-2, 2], OpenAI's definition) subtract, per token
    already in the output, a constant and its count times the penalty.
    `logit_bias` ({token id: bias in [-100, 100]}) is added to the logits.

    `cache_salt` (vLLM's): folded into the first KV block's hash, so the request
    shares prefix-cache blocks only with requests of the same salt; one salt per
    tenant keeps one tenant from learning (by `cached_tokens` or TTFT) what
    another's prompts were.

    Frozen: validated once where it is built (the gateway, `LLM.generate`), it
    travels to the workers as it is; `dataclasses.replace` makes a changed copy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # N: the log-probability of every prompt token after the first given the ones before
    # it, with the top-N (vLLM's prompt_logprobs). Such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # False: no speculative decoding for this request, even when the engine drafts for others.
    speculative: bool = True
    cache_salt: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalised forms (frozen: through object.__setattr__, before anyone sees them).
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", [int(t) for t in (self.stop_token_ids or [])])
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", self._parse_logit_bias(self.logit_bias))
        self._validate()

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        return self if self.output_kind is kind else dataclasses.replace(self, output_kind=kind)

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n: must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs: must be a non-negative integer, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs: must be a non-negative integer, got {self.prompt_logprobs!r}")
        assert isinstance(self.stop, list) and self.stop_token_ids is not None  # normalised above
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise ValueError(f"{name}: must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty: must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt: must be a non-empty string, got {self.cache_salt!r}")

    @staticmethod
    def _parse_logit_bias(bias: object) -> dict[int, float] | None:
        """{token id: bias}; JSON clients send the ids as strings (OpenAI's format)."""
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise ValueError("logit_bias: must be an object mapping token ids to biases")
        out: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} must be >= 0")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias: bias of token {token} must be a number in [-100, 100], got {value!r}")
            out[token] = float(value)
        return out

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """Whether anything but the sampling distribution's shape (temperature, top-k/p, min-p) acts on the logits."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
