"""The gateway's decode of a `TokenDeltaBatch`: the same checks as `messages.decode_as`, fast.

Why: the gateway decodes one batch per engine step per worker and one delta per token of
every stream; the generic decode (a reader per field, a checked dataclass per record) took
~10 us a delta, a fifth of a gateway replica's CPU per streamed token (docs/performance.md,
"The front door"). Here a delta in its usual shape (no logprobs, the fields of the types
`TokenDelta` declares) is checked field by field in one expression and built without its
`__init__`, in ~1 us. Anything else (logprobs, an int where a float goes, a bad value) sends
the whole message through `decode_as`, which converts what it may and raises the
`ValueError` naming what is wrong: a message accepted here is one `decode_as` accepts, and
decodes equal (tests/workers/test_token_decode.py checks both over generated messages).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from pdserve.workers.messages import MAX_MESSAGE_BYTES, MessageType, TokenDelta, TokenDeltaBatch, decode_as

_INT64_MIN = -(1 << 63)
_UINT64_MAX = (1 << 64) - 1
_FIELDS = tuple(f.name for f in dataclasses.fields(TokenDelta))
_BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(TokenDeltaBatch)) - {"version"}
_VERSION = next(f.default for f in dataclasses.fields(TokenDeltaBatch) if f.name == "version")
_TYPE = int(MessageType.TOKEN_DELTA_BATCH)


def _int(v: Any) -> bool:
    return type(v) is int and _INT64_MIN <= v <= _UINT64_MAX


def _delta(row: Any) -> TokenDelta | None:
    """The TokenDelta of a wire row in the usual shape, or None (the full decode decides)."""
    if type(row) is not list or len(row) != len(_FIELDS):
        return None
    rid, offset, ids, text, finish, stop_token, stop_string, cached, cumulative, logprobs, queued, prompt, attempt = row
    if not (type(rid) is str and _int(offset) and type(ids) is list and type(text) is str
            and (finish is None or type(finish) is str) and (stop_token is None or _int(stop_token))
            and (stop_string is None or type(stop_string) is str) and _int(cached)
            and (cumulative is None or type(cumulative) is float) and logprobs is None
            and (queued is None or type(queued) is float) and prompt is None and _int(attempt)):
        return None
    if ids and not (all(type(t) is int for t in ids) and _INT64_MIN <= min(ids) and max(ids) <= _UINT64_MAX):
        return None
    d = object.__new__(TokenDelta)  # every field checked above: what __init__ would check
    d.__dict__.update(zip(_FIELDS, row))
    d.__dict__["token_ids"] = tuple(ids)
    return d


def decode_token_batch(data: bytes | bytearray | memoryview) -> TokenDeltaBatch:
    """`decode_as(data, TokenDeltaBatch)`: the batch, or a ValueError naming what is wrong."""
    if len(data) <= MAX_MESSAGE_BYTES:
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception:  # noqa: BLE001 - msgpack raises several types; the full decode names the fault
            obj = None
        if (type(obj) is list and len(obj) == 3 and obj[0] == _TYPE and type(obj[0]) is int and obj[1] == _VERSION
                and type(obj[1]) is int and type(obj[2]) is dict and obj[2].keys() == _BATCH_FIELDS):
            body = obj[2]
            worker_id, seq, rows = body["worker_id"], body["seq"], body["deltas"]
            if type(worker_id) is str and _int(seq) and type(rows) is list:
                deltas = tuple(map(_delta, rows))
                if all(d is not None for d in deltas):
                    batch = object.__new__(TokenDeltaBatch)
                    batch.__dict__.update(worker_id=worker_id, seq=seq, deltas=deltas, version=_VERSION)
                    return batch
    return decode_as(data, TokenDeltaBatch)
