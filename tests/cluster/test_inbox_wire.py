"""What crosses the wire to a worker's inbox (workers/inbox_wire.py) comes back as it was
sent; garbage is a ValueError naming what is wrong; a try's error comes back as its type."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgpack
import pytest
from inbox_doubles import PARAMS, channel_to, eventually, hang, request

from pdserve.cluster.worker_inbox import TryReport
from pdserve.workers.async_engine import EngineDeadError, RequestFaultError, WorkerDrainingError
from pdserve.workers.handoff import Resume
from pdserve.workers.inbox_wire import AbortTry, StartTry, decode_inbox, encode_abort, encode_start
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.token_stream import StreamLostError


@pytest.mark.parametrize("params", PARAMS)
def test_a_start_reads_back_as_the_request_sent(params: SamplingParams) -> None:
    req = request(params, attempt=2, resume=Resume((4, 5), 7, -1.5))
    msg = decode_inbox(encode_start("gw", 9, req, prefill_worker="prefill-0"))
    assert msg == StartTry("gw", 9, req, "prefill-0")
    assert decode_inbox(encode_abort("gw", 10, "r1", 2)) == AbortTry("gw", 10, "r1", 2)


def test_a_lone_surrogate_a_json_client_sent_crosses_the_wire_as_sent() -> None:
    """JSON strings may carry lone surrogates ("\\ud800"), and the gateway takes a client's stop
    strings and cache salt as they came (the salt's hash takes them: workers/kv/hashing.py).
    Strict UTF-8 cannot carry them: encoding such a start raised UnicodeEncodeError, and the
    client got a 400 naming no field for a request the gateway had taken (and a worker serves)."""
    params = SamplingParams(stop=["end\ud800"], cache_salt="tenant-\udcff")
    req = request(params)
    assert decode_inbox(encode_start("gw", 1, req)) == StartTry("gw", 1, req)

    async def main() -> None:
        async with channel_to(hang) as (svc, channel):
            run = asyncio.create_task(channel.run(req, asyncio.Event()))
            await eventually(lambda: len(svc.started) == 1 or run.done())
            assert not run.done(), run.exception()
            assert svc.started[0].request == req
            run.cancel()

    asyncio.run(main())


def _start_body(**change: Any) -> list[Any]:
    body = msgpack.unpackb(encode_start("gw", 1, request()), strict_map_key=False)
    fields = ["version", "kind", "sender", "seq", "request_id", "prompt", "params", "timeout_s", "reply_to",
              "attempt", "resume", "prefill"]
    for name, value in change.items():
        body[fields.index(name)] = value
    return list(body)


@pytest.mark.parametrize("change, names", [
    ({"version": 2}, "version"),
    ({"kind": "run"}, "kind"),
    ({"seq": -1}, "seq"),
    ({"request_id": ""}, "request_id"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "abc"}, "prompt"),
    ({"params": {"temperature": -1}}, "temperature"),
    ({"params": {"tool": 1}}, "unknown fields"),
    ({"params": {"logit_bias": {1.5: 1.0}}}, "logit_bias"),
    ({"params": {"output_kind": "all"}}, "output_kind"),
    ({"params": {"structured_outputs": {"json": "{", "exec": 1}}}, "structured_outputs"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"attempt": -1}, "attempt"),
    ({"resume": [[], 0, None]}, "resume"),
    ({"resume": [[1], 0, "x"]}, "cumulative_logprob"),
    ({"prefill": 5}, "prefill_worker"),
])
def test_a_malformed_start_is_a_value_error_naming_the_field(change: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        decode_inbox(msgpack.packb(_start_body(**change)))


@pytest.mark.parametrize("data", [b"", b"\xc1", os.urandom(64), msgpack.packb({"a": 1}), msgpack.packb([1])])
def test_garbage_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_inbox(data)


def test_try_errors_come_back_as_their_types() -> None:
    for error in (ValueError("prompt: too long"), TimeoutError("late"), RequestFaultError("nan"),
                  EngineDeadError("dead"), WorkerDrainingError("switching"), StreamLostError("lost"),
                  KeyError("bug")):
        back = TryReport.failed(1, "r", 0, error).error()
        assert type(back) is (RuntimeError if isinstance(error, KeyError) else type(error))
        assert str(back) == str(error)
