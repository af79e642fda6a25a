"""The gateway's fast paths for the token stream against their oracles: the TokenDeltaBatch
decode (workers/token_decode.py) against the generic `messages.decode_as` (over generated wire
messages, valid ones in every shape and ones with one field wrong, the two accept the same
messages and decode them equal, and refuse the same ones with a ValueError), and one output of
several deltas (`from_deltas`) against their outputs merged one by one."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.workers.messages import MessageType, TokenDelta, TokenDeltaBatch, TokenLogprobs, decode_as, encode
from pdserve.workers.outputs import merge_deltas
from pdserve.workers.token_decode import decode_token_batch
from pdserve.workers.token_stream import from_delta, from_deltas

# msgpack holds integers in [-2**63, 2**64): the extremes of that, and small ones.
INT = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([-(2**63), 2**64 - 1, 0, 1]))
ANY = st.one_of(st.none(), st.booleans(), INT, st.floats(allow_nan=False), st.text(max_size=4),
                st.lists(st.integers(0, 9), max_size=2))
LOGPROBS = st.one_of(st.none(), st.lists(st.tuples(st.lists(st.integers(0, 99), min_size=1, max_size=2),
                                                   st.lists(st.floats(-10, 0), min_size=1, max_size=2))
                                         .map(list), max_size=2))


def _float_or_int() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5))


ROW = st.tuples(
    st.text(max_size=8), INT, st.lists(INT, max_size=4), st.text(max_size=8),
    st.one_of(st.none(), st.sampled_from(["stop", "length"])), st.one_of(st.none(), INT),
    st.one_of(st.none(), st.text(max_size=3)), INT, _float_or_int(), LOGPROBS, _float_or_int(),
    st.one_of(st.none(), st.just([[[], []], [[5], [-1.0]]])), INT,
).map(list)


@st.composite
def rows(draw: st.DrawFn) -> list[Any]:
    """A delta's wire row: well formed (the usual shape or not), or with one field replaced by anything."""
    row: list[Any] = draw(ROW)
    if draw(st.booleans()):
        row[draw(st.integers(0, len(row) - 1))] = draw(ANY)
    if draw(st.integers(0, 9)) == 0:
        row = row[: draw(st.integers(0, len(row)))]  # too short
    return row


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    body: dict[str, Any] = {"worker_id": draw(st.one_of(st.text(max_size=6), INT)), "seq": draw(INT),
                            "deltas": draw(st.lists(rows(), max_size=4))}
    head = [int(MessageType.TOKEN_DELTA_BATCH), 5]
    match draw(st.integers(0, 19)):
        case 0:
            head[1] = 4  # another version
        case 1:
            head[0] = int(MessageType.KV_EVENT_BATCH)
        case 2:
            body["extra"] = 1
        case 3:
            del body["seq"]
        case _:
            pass
    data: bytes = msgpack.packb([*head, body], use_bin_type=True)
    return data


def _outcome(decode: Any, data: bytes) -> Any:
    try:
        return decode(data)
    except ValueError:
        return ValueError


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN-free floats compared exactly; TokenDelta fields one by one (a float field may be NaN-free here)."""
    if a is ValueError or b is ValueError:
        return a is b
    assert isinstance(a, TokenDeltaBatch) and isinstance(b, TokenDeltaBatch)
    return a == b and all(type(x.token_ids) is tuple for x in a.deltas)


@settings(max_examples=600, deadline=None)
@given(messages())
def test_fast_decode_accepts_refuses_and_decodes_as_the_generic_one(data: bytes) -> None:
    assert _same(_outcome(decode_token_batch, data), _outcome(lambda d: decode_as(d, TokenDeltaBatch), data))


def test_a_usual_batch_takes_the_fast_path_and_equals_the_encoded_records() -> None:
    deltas = tuple(TokenDelta(f"r{i}", 3, (5, i), " x", None, None, None, 0, None, None, 0.5 if i else None)
                   for i in range(3))
    batch = TokenDeltaBatch(worker_id="w#1", seq=7, deltas=deltas)
    decoded = decode_token_batch(encode(batch))
    assert decoded == batch and decoded.deltas[1].token_ids == (5, 1)
    assert not math.isnan(decoded.deltas[1].queue_time_s or 0.0)


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([7, 5, {"worker_id": "w", "seq": 1.5, "deltas": []}]),
                                  msgpack.packb([7, 5, {"worker_id": "w", "seq": 1, "deltas": [["r"]]}]),
                                  b"x" * ((1 << 20) + 1)])
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_token_batch(data)


USUAL = ["r1", 3, [5, 6], " x", None, None, None, 0, None, None, 0.25, None, 0]
WRONG = [None, True, 1, -1, 2.5, "s", b"b", [1], ["s"], {"k": 1}]


@pytest.mark.parametrize("field", range(len(USUAL)))
def test_each_field_of_a_usual_delta_wrong_in_each_way_is_judged_as_the_generic_decode_judges(field: int) -> None:
    for wrong in WRONG:
        row = list(USUAL)
        row[field] = wrong
        data = msgpack.packb([int(MessageType.TOKEN_DELTA_BATCH), 5, {"worker_id": "w", "seq": 0, "deltas": [row]}])
        assert _same(_outcome(decode_token_batch, data), _outcome(lambda d: decode_as(d, TokenDeltaBatch), data)), (
            field, wrong)


LOGPROB_ENTRIES = st.lists(st.builds(lambda i, j: TokenLogprobs((i, j), (-0.5, -1.5)), st.integers(0, 99),
                                     st.integers(0, 99)), max_size=2)
DELTAS = st.lists(st.builds(
    TokenDelta, st.just("r"), st.integers(0, 9), st.lists(st.integers(0, 99), max_size=3).map(tuple),
    st.text(max_size=3), st.none(), st.one_of(st.none(), st.integers(0, 9)), st.one_of(st.none(), st.text(max_size=2)),
    st.integers(0, 9), st.one_of(st.none(), st.floats(-9, 0)), st.one_of(st.none(), LOGPROB_ENTRIES.map(tuple)),
    st.one_of(st.none(), st.floats(0, 1)),
    st.one_of(st.none(), st.lists(st.sampled_from([TokenLogprobs((), ()), TokenLogprobs((7,), (-1.0,))]),
                                  max_size=2).map(tuple)),
), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(DELTAS, st.sampled_from([None, "stop", "length"]))
def test_one_output_of_many_deltas_is_their_outputs_merged(deltas: list[TokenDelta], finish: str | None) -> None:
    deltas[-1] = dataclasses.replace(deltas[-1], finish_reason=finish)
    want = functools.reduce(merge_deltas, (from_delta(d, [1, 2]) for d in deltas))
    assert from_deltas(deltas, [1, 2]) == want
