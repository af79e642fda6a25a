"""What one API request may ask for, and why a request was refused.

The bounds keep one client from spending the gateway's memory or the engine
thread's time: every list a request carries (prompts, choices, stop strings,
messages, logit biases) is bounded before anything is tokenized or admitted.
`RequestLimits` comes from `pdserve serve`'s flags (cluster/serve_config.py);
the checks are pure functions over a parsed request, so they are tested with
no server. `RefusalReason` names each refusal in the gateway's
`pdserve:requests_refused_total{reason}` counter.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pydantic import PositiveInt
from pydantic.dataclasses import dataclass

from pdserve.workers.config import CONFIG, Seconds, named_errors


class RefusalReason(str, enum.Enum):
    """Why the gateway turned a request away before it ran (a metric label)."""

    AUTH = "auth"  # 401: no or a wrong API key
    BODY_TOO_LARGE = "body_too_large"  # 413
    BODY_TIMEOUT = "body_timeout"  # 408: the body came too slowly
    MALFORMED = "malformed"  # 400: not JSON, not UTF-8, a field of the wrong type or out of range
    UNSUPPORTED = "unsupported"  # 400: a field pdserve does not honour (tools, response_format, ...)
    LIMIT = "limit"  # 400: over one of `RequestLimits`
    CAPACITY = "capacity"  # 429: the admission bound
    UNAVAILABLE = "unavailable"  # 503: no healthy worker
    WRITE_TIMEOUT = "write_timeout"  # a client that stopped reading its response


@named_errors()
@dataclass(frozen=True, config=CONFIG)
class RequestLimits:
    """Bounds on one request; each is a `pdserve serve` flag of the same name."""

    max_n: PositiveInt = 128  # choices per prompt (OpenAI's bound on n)
    max_prompts: PositiveInt = 64  # prompts in one /v1/completions request
    max_stop: PositiveInt = 64  # stop strings, and stop token ids, per request
    max_stop_length: PositiveInt = 1024  # characters in one stop string
    max_messages: PositiveInt = 1024  # chat messages per request
    max_logit_bias: PositiveInt = 1024  # logit_bias entries per request
    max_cache_salt_length: PositiveInt = 256
    max_body_bytes: PositiveInt = 16 << 20  # a request body; beyond it, 413 before it is parsed
    body_timeout: Seconds = 30.0  # seconds to receive a whole body once its headers are in (408 after)
    write_timeout: Seconds = 30.0  # seconds a response write may wait on a client that does not read


class Refused(ValueError):
    """A request over one of the bounds, or asking for what pdserve does not do:
    a 400 whose `param` names the field, counted under `reason`."""

    def __init__(self, param: str, message: str, reason: RefusalReason = RefusalReason.LIMIT) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.reason = param, reason


def check_count(param: str, items: Sequence[object] | None, most: int, flag: str) -> None:
    if items is not None and len(items) > most:
        raise Refused(param, f"at most {most} per request, got {len(items)} (the server's --{flag})")


def check_stop(stop: str | Sequence[str] | None, stop_token_ids: Sequence[int] | None,
               limits: RequestLimits) -> None:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    check_count("stop", strings, limits.max_stop, "max-stop")
    check_count("stop_token_ids", stop_token_ids, limits.max_stop, "max-stop")
    longest = max(map(len, strings), default=0)
    if longest > limits.max_stop_length:
        raise Refused("stop", f"a stop string has at most {limits.max_stop_length} characters, got {longest} "
                              "(the server's --max-stop-length)")


def check_n(n: int, best_of: int | None, limits: RequestLimits) -> None:
    # Before admission: a request's share of the admission bound is its prompts x n, so an n
    # below 1 would take a negative share and let any number of requests past the bound.
    if n < 1:
        raise Refused("n", f"must be at least 1, got {n}", RefusalReason.MALFORMED)
    if n > limits.max_n:
        raise Refused("n", f"at most {limits.max_n}, got {n} (the server's --max-n)")
    # best_of > n asks the server to rank samples and return the best: pdserve does not.
    if best_of is not None and best_of != n:
        raise Refused("best_of", f"pdserve returns every sample it makes: only best_of equal to n ({n}) is "
                                 f"accepted, got {best_of}", RefusalReason.UNSUPPORTED)
