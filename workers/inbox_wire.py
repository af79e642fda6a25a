"""What a gateway writes to a worker's inbox: start a try of a request, or abort one.

A Ray actor call costs a caller ~580 us of CPU and the actor ~515 (docs/performance.md,
"The front door"): a third of what the gateway spent on a one-token request, and up to
~8 us of every token of a 64-token one, on each side. So a gateway starts requests with
one ZeroMQ message to the worker's inbox (cluster/worker_inbox.py) instead, and aborts
them on the same socket (so an abort never overtakes the start it ends).

The wire form is msgpack, never pickle: a peer that can reach the socket can write to
it. Strings go as written, a client's lone surrogates included (`_UNICODE_ERRORS`). Every
field is checked as it is read (a ValueError names it), and the request's
`SamplingParams` are rebuilt through their own constructor, which validates them as it
does a client's. The messages are signed by the sender (`auth.inbox_tag`) and numbered
per sender; the inbox checks both before it reads a field.

    [VERSION, "start", sender, seq, request_id, prompt, params, timeout_s, reply_to,
     attempt, resume (None or [token_ids, text_chars, cumulative_logprob]), prefill_worker]
    [VERSION, "abort", sender, seq, request_id, attempt]
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.workers.handoff import Resume, ServeRequest
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.structured_outputs import StructuredOutputs

VERSION = 1
# A start message is a prompt and its parameters (a grammar spec at most 64k characters).
MAX_INBOX_MESSAGE_BYTES = 4 << 20
_START, _ABORT = "start", "abort"
# A client's JSON strings (stop strings, a cache salt) may hold lone surrogates ("\\ud800"), which
# strict UTF-8 refuses: a start that carries them must still go, and read back as it was sent.
_UNICODE_ERRORS = "surrogatepass"
_PARAM_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_STRUCTURED_FIELDS = frozenset(f.name for f in dataclasses.fields(StructuredOutputs))
# Defaults left off the wire: most requests set a handful of the ~25 fields.
_PARAM_DEFAULTS = {name: f.default for name, f in _PARAM_FIELDS.items() if f.default is not dataclasses.MISSING}


@dataclass(frozen=True)
class StartTry:
    """Run `request` here; `prefill_worker` names the prefill worker of a handoff (None: serve it here)."""

    sender: str
    seq: int
    request: ServeRequest
    prefill_worker: str | None = None


@dataclass(frozen=True)
class AbortTry:
    """Drop try `attempt` (or an earlier one) of `request_id`."""

    sender: str
    seq: int
    request_id: str
    attempt: int


InboxMessage = StartTry | AbortTry


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    """The fields of `p` that differ from their defaults, in msgpack's types."""
    out: dict[str, Any] = {}
    for name, default in _PARAM_DEFAULTS.items():
        value = getattr(p, name)
        if value == default or (name in ("stop", "stop_token_ids") and not value):
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, StructuredOutputs):
            value = {k: v for k, v in dataclasses.asdict(value).items() if not (v is None or v is False or v == "")}
        out[name] = value
    return out


def params_from_wire(d: Any) -> SamplingParams:
    """The SamplingParams `params_to_wire` wrote (ValueError for anything else)."""
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError("params: must be a map of field names")
    unknown = set(d) - set(_PARAM_DEFAULTS)
    if unknown:
        raise ValueError(f"params: unknown fields {sorted(unknown)}")
    kw = dict(d)
    if "output_kind" in kw:
        kind = kw["output_kind"]
        kinds = {k.value: k for k in type(_PARAM_DEFAULTS["output_kind"])}
        if kind not in kinds:
            raise ValueError(f"params.output_kind: unknown kind {kind!r}")
        kw["output_kind"] = kinds[kind]
    so = kw.get("structured_outputs")
    if so is not None and (not isinstance(so, dict) or not set(so) <= _STRUCTURED_FIELDS):
        raise ValueError("params.structured_outputs: must be a map of its fields")
    if isinstance(kw.get("logit_bias"), dict):  # parsed as a client's: str keys (a float key is refused)
        kw["logit_bias"] = {str(k): v for k, v in kw["logit_bias"].items()}
    return SamplingParams(**kw)  # validates every value, as for a client's request


def encode_start(sender: str, seq: int, req: ServeRequest, prefill_worker: str | None = None) -> bytes:
    resume = None if req.resume is None else [list(req.resume.token_ids), req.resume.text_chars,
                                              req.resume.cumulative_logprob]
    body = [VERSION, _START, sender, seq, req.request_id, list(req.prompt_token_ids), params_to_wire(req.params),
            req.timeout_s, req.reply_to, req.attempt, resume, prefill_worker]
    data: bytes = msgpack.packb(body, use_bin_type=True, unicode_errors=_UNICODE_ERRORS)
    return data


def encode_abort(sender: str, seq: int, request_id: str, attempt: int) -> bytes:
    data: bytes = msgpack.packb([VERSION, _ABORT, sender, seq, request_id, attempt], use_bin_type=True,
                                unicode_errors=_UNICODE_ERRORS)
    return data


def decode_inbox(data: bytes) -> InboxMessage:
    """The message `data` holds; ValueError (naming the field) for anything malformed."""
    try:
        # Int keys only where a logit bias needs them; any other map is checked below.
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, unicode_errors=_UNICODE_ERRORS)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise ValueError(f"inbox message: not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, list) or len(obj) < 4 or obj[0] != VERSION:
        raise ValueError("inbox message: not a version-1 inbox message")
    kind, sender, seq = obj[1], _str("sender", obj[2]), _int("seq", obj[3], 0)
    if kind == _ABORT and len(obj) == 6:
        return AbortTry(sender, seq, _str("request_id", obj[4]), _int("attempt", obj[5], 0))
    if kind != _START or len(obj) != 12:
        raise ValueError(f"inbox message: unknown kind {kind!r} or wrong length {len(obj)}")
    _, _, _, _, rid, prompt, params, timeout_s, reply_to, attempt, resume, prefill = obj
    req = ServeRequest(_str("request_id", rid), _ints("prompt", prompt), params_from_wire(params),
                       _timeout(timeout_s), _str("reply_to", reply_to), _int("attempt", attempt, 0),
                       _resume(resume))
    return StartTry(sender, seq, req, None if prefill is None else _str("prefill_worker", prefill))


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{name}: must be a non-empty string")
    return v


def _int(name: str, v: Any, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name}: must be an integer >= {low}")
    return v


def _ints(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ValueError(f"{name}: must be a list of token ids")
    return tuple(v)


def _timeout(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf:
        raise ValueError("timeout_s: must be a finite number > 0")
    return float(v)


def _resume(v: Any) -> Resume | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 3:
        raise ValueError("resume: must be [token_ids, text_chars, cumulative_logprob]")
    lp = v[2]
    if lp is not None and (not isinstance(lp, (int, float)) or isinstance(lp, bool)):
        raise ValueError("resume.cumulative_logprob: must be a number or null")
    return Resume(_ints("resume.token_ids", v[0]), _int("resume.text_chars", v[1], 0),
                  None if lp is None else float(lp))
