"""Per-request sampling parameters, validated where they enter."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.workers.structured_outputs import StructuredOutputs

# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits divided by a denormal
# temperature overflow to +-inf, and a softmax of them is NaN.
GREEDY_BELOW = 1e-5
# What every integer field must fit: the engine packs seeds and token ids into int64 tensors.
_INT64 = (-(2**63), 2**64)
# A repetition penalty divides or multiplies logits: bounded so that with the greedy floor
# above and the largest penalties and biases, a logit stays far from float32's range.
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
# bad_words: each word is checked against the output's tail at every step of its request; vLLM's
# GPU runner holds at most 128 words a request.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every step: all tokens and text so far
    DELTA = "delta"  # every step: only what is new (streaming)
    FINAL_ONLY = "final_only"  # once, when the request finishes


GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi: spreads consecutive integers over 64 bits


def mix64(x: int) -> int:
    """splitmix64's finaliser: nearby inputs get unrelated 64-bit outputs."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample j of a request seeded `seed` with n > 1: `seed` itself for sample 0 (n=1
    results stay as they were), an unrelated one (in the signed 64-bit range) for the others. Not
    seed + j: then seeds 7 and 8 with n=2 shared a sample, and a sweep over seeds repeated most of them."""
    if seed is None or j == 0:
        return seed
    u = mix64((seed & ((1 << 64) - 1)) ^ mix64(j * GOLDEN))
    return u - (1 << 64) if u >= 1 << 63 else u

@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (the fields vLLM users know).

    temperature 0 (or below 1e-5, as vLLM) means greedy. top_k 0 (or -1) and top_p 1 disable those
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

    vLLM's vocabulary restrictions: `allowed_token_ids` (a non-empty list: no other token
    can be sampled) and `bad_words` (each word's tokens, as it tokenizes alone and after a
    space, never all appear in the output: its last token is banned wherever the output
    ends with the ones before it).

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
    # vLLM's: the prompt's last N tokens are kept (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # False: no speculative decoding for this request, even when the engine drafts for others.
    speculative: bool = True
    cache_salt: str | None = None
    # What the output must match (a JSON schema, a regex, choices, a grammar): workers/grammar.py.
    # A dict is taken as StructuredOutputs' fields.
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalised forms (frozen: through object.__setattr__, before anyone sees them).
        # numpy's scalars (np.int64(5), np.float32(0.7): what arithmetic on numpy arrays gives) as
        # Python's, as token id lists already were: they were refused as "must be an integer".
        # (Python's own types skip the numbers ABCs' checks: ~0.5 us each, on every request.)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) not in _PLAIN and _is_integer(value):
                object.__setattr__(self, name, int(value))
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) not in _PLAIN and isinstance(value, numbers.Real):  # (numpy's bool is not one)
                object.__setattr__(self, name, float(value))
        stop = [self.stop] if isinstance(self.stop, str) else list(_sequence("stop", self.stop))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        _flags(self, "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize", "speculative")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind: must be a RequestOutputKind, got {self.output_kind!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "logit_bias", self._parse_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", sorted(set(_token_ids("allowed_token_ids",
                                                                                self.allowed_token_ids))))
        if self.bad_words is not None:
            object.__setattr__(self, "bad_words", list(_sequence("bad_words", self.bad_words)) or None)
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputs(**self.structured_outputs))
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs: must be StructuredOutputs or an object of its fields")
        self._validate()
        if self.temperature == 0.0:
            # Greedy takes the argmax: top-k, top-p and min-p mean nothing to it (vLLM resets them
            # too). Left set, a greedy row batched with sampled ones had them cut its logits before
            # its grammar's check masked what was left, and a cut that kept no allowed token
            # failed the request.
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    def with_output_kind(self, kind: RequestOutputKind) -> SamplingParams:
        return self if self.output_kind is kind else dataclasses.replace(self, output_kind=kind)

    def _validate(self) -> None:
        """Every value in a range the engine can take whatever the model: what depends on the
        model (the vocabulary, its context) is `inputs.check_request`'s."""
        _integer("n", self.n, 1)
        _number("temperature", self.temperature, 0.0, math.inf, "must be a finite number >= 0")
        if not 0.0 < _number("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]"):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, 0, _INT64[1], "must be 0 or -1 (disabled) or a positive integer")
        _number("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, hint="must be a non-negative integer")
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, hint="must be a non-negative integer")
        assert isinstance(self.stop, list) and self.stop_token_ids is not None  # normalised above
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        if self.stop and not self.detokenize:
            # A stop string is matched in the text, which detokenize=False does not make (vLLM refuses it too).
            raise ValueError("stop: stop strings need detokenize=True (use stop_token_ids to stop without text)")
        if any(not 0 <= t < _INT64[1] for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        if self.seed is not None:
            _integer("seed", self.seed, _INT64[0], _INT64[1], f"must be an integer in [{_INT64[0]}, {_INT64[1]})")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), -2.0, 2.0, "must be in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        _number("repetition_penalty", self.repetition_penalty, low, high, f"must be in [{low:g}, {high:g}] (1 = off)")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, hint="must be -1 or an integer >= 1")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids: must name at least one token (or be left out)")
            if self.allowed_token_ids[0] < 0 or self.allowed_token_ids[-1] >= _INT64[1]:
                raise ValueError("allowed_token_ids: token ids must be >= 0")
        words = self.bad_words or []
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
        if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise ValueError(f"bad_words: every word must be a string with a non-space character and at most "
                             f"{MAX_BAD_WORD_CHARS} characters")
        if not all(_utf8(w) for w in words):  # the tokenizer takes no lone surrogate ("\ud800" in JSON)
            raise ValueError("bad_words: not valid Unicode (a lone surrogate)")
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
            # A token id, or its decimal text (JSON's keys) in ASCII digits: int() of a float or a
            # bool key (5.5, True) was a silent token 5 or 1, and of "5_0", " 5 " or a full-width
            # "５" a token the client did not write.
            if _is_integer(key) or (isinstance(key, str) and _DECIMAL.fullmatch(key)):
                token = int(key)  # (an Integral, or its digits)
            else:
                raise ValueError(f"logit_bias: key {str(key)[:40]!r} is not a token id")
            if not 0 <= token < _INT64[1]:
                raise ValueError(f"logit_bias: token id {token} must be >= 0")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias: bias of token {token} must be a number in [-100, 100], got {value!r}")
            out[token] = float(value)
        return out

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def depends_on_history(self) -> bool:
        """Whether what acts on its logits depends on the output so far (penalties, bad_words):
        such a request drafts nothing, and its next step waits for its last token."""
        return self.has_penalties or bool(self.bad_words)

    @property
    def constraint(self) -> StructuredOutputs | None:
        """`structured_outputs`, typed (__post_init__ made any dict one)."""
        so = self.structured_outputs
        assert so is None or isinstance(so, StructuredOutputs)
        return so

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value: object, low: int, high: int | None = None, hint: str | None = None) -> int:
    """`value` if it is an integer (not a bool) in [low, high); else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        raise ValueError(f"{name}: {hint or f'must be an integer >= {low}'}, got {value!r}")
    return value


def _number(name: str, value: object, low: float, high: float, hint: str) -> float:
    """`value` if it is a finite number in [low, high] (NaN and the infinities are refused)."""
    # An int too large for a float (10**400) is refused too: math.isfinite and float() of it
    # raised OverflowError, not a ValueError.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _FLOAT_MAX:
        raise ValueError(f"{name}: {hint}, got an integer of {len(str(abs(value)))} digits")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"{name}: {hint}, got {value!r}"[:200])
    return float(value)


# What was taken before as it came: int() of every stop token id (a TypeError for None or an
# int, 1.7 a silent 1, "12" the ids 1 and 2), list() of `stop` (a TypeError for an int), and a
# flag's truthiness (ignore_eos="no" ignored EOS). Wrong types are ValueErrors naming the field.


_DECIMAL = re.compile(r"-?[0-9]+")
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed",
               "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_PLAIN = frozenset({int, float, bool, type(None)})
_FLOAT_MAX = int(sys.float_info.max)


def _is_integer(value: object) -> bool:
    """An integer of any kind (Python's, numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _sequence(name: str, value: object) -> Iterable[object]:
    """`value` as the list-like it must be (None: empty); not a string, bytes or a mapping."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name}: must be a list, got {type(value).__name__}")
    return value


def _token_ids(name: str, value: object) -> list[int]:
    ids = list(_sequence(name, value))
    if not all(_is_integer(t) for t in ids):
        raise ValueError(f"{name}: token ids must be integers, got {ids!r}"[:200])
    return [int(t) for t in ids]  # type: ignore[call-overload]  # integers, checked above


def _flags(params: SamplingParams, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name}: must be true or false, got {getattr(params, name)!r}")


def _utf8(text: str) -> bool:
    """Whether `text` is Unicode a tokenizer can take: it encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
