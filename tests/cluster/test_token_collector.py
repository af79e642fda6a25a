"""The gateway's token collector (cluster/token_collector.py): deltas put back in order,
a broken or short stream is an error and never a shorter answer, and `watch` ends a try
on its call's error, a broken stream, a final delta that never came, or the deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest
import zmq

from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.lifecycle import Exit, RequestState
from pdserve.workers.messages import TokenDelta, TokenDeltaBatch, encode
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.token_stream import StreamLostError, TokenStreamPublisher
from pdserve.workers.transfer import auth


def output(rid: str, tokens: list[int], text: str, finish: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, text, tokens, None, None, finish, 7 if finish == "stop" else None)
    return RequestOutput(rid, None, [1, 2, 3], [c], finish is not None, num_cached_tokens=16)


async def _consume(collector: TokenStreamCollector, rid: str, call: Awaitable[object]) -> list[RequestOutput]:
    """The request's deltas as the gateway reads a lone try of it (no retries)."""
    return [o async for o in collector.consume(rid, collector.watch(rid, call))]


def test_the_workers_error_reaches_the_consumer() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("a", [1], 10.0)

        async def rpc() -> None:
            raise ValueError("prompt: too long")

        with pytest.raises(ValueError, match="too long"):
            await _consume(collector, "a", rpc())
        await collector.close()

    asyncio.run(run())


def test_a_final_delta_that_never_comes_is_an_error_not_a_hang() -> None:
    async def run() -> None:
        collector = TokenStreamCollector(final_grace_s=0.2)
        collector.open("a", [1], 10.0)

        async def rpc() -> None:  # the worker says "done", but its last message was lost
            return None

        t = time.monotonic()
        with pytest.raises(StreamLostError):
            await _consume(collector, "a", rpc())
        assert time.monotonic() - t < 2.0
        await collector.close()

    asyncio.run(run())


def test_the_deadline_holds_when_the_worker_says_nothing() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        life = collector.open("a", [1], 0.2)
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await _consume(collector, "a", never)
        assert life.state is RequestState.FAILED and life.exit is Exit.DEADLINE
        await collector.close()

    asyncio.run(run())


def test_garbage_on_the_socket_is_dropped_and_the_stream_goes_on() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("a", [1], 10.0)
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(collector.address)

        def signed(body: bytes) -> list[bytes]:  # garbage from a holder of the secret: past the MAC, then refused
            return [auth.token_tag(auth.default_secret(), collector.address, body), body]

        sock.send_multipart(signed(b"\x93\x07\x01\x80"))  # a TokenDeltaBatch header with no fields
        sock.send_multipart(signed(b"not msgpack at all"))
        delta = TokenDelta("a", 0, (4,), "t", "length", None, None, 0, None, None)
        ok = TokenDeltaBatch(worker_id="w", seq=0, deltas=(delta,))
        sock.send_multipart(signed(encode(ok)))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        outs = await _consume(collector, "a", done)
        assert [o.outputs[0].token_ids for o in outs] == [[4]] and collector.num_rejected == 2
        sock.close(linger=0)
        await collector.close()

    asyncio.run(run())


def test_deltas_from_two_workers_are_put_back_in_order() -> None:
    """After a handoff the prefill worker sends token 1 and the decode worker the
    rest, on two connections: a delta that overtakes an earlier one waits for it,
    a repeat is dropped, and the request's lifecycle walks to FINISHED."""

    async def run() -> None:
        collector = TokenStreamCollector()
        life = collector.open("r", [1, 2], 10.0)
        prefill, decode = TokenStreamPublisher("p"), TokenStreamPublisher("d")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        consumer = asyncio.ensure_future(_consume(collector, "r", done))
        decode.add(collector.address, output("r", [6, 7], "bc"), 1)
        decode.flush()
        await asyncio.sleep(0.2)  # the decode worker's deltas arrive first
        prefill.add(collector.address, output("r", [5], "a"), 0)
        prefill.flush()
        decode.add(collector.address, output("r", [6], "b"), 1)  # a repeat: dropped
        decode.add(collector.address, output("r", [8], "d", "length"), 3)
        decode.flush()
        done.set_result(None)
        outs = await consumer
        assert [t for o in outs for t in o.outputs[0].token_ids] == [5, 6, 7, 8]
        assert "".join(o.outputs[0].text for o in outs) == "abcd"
        assert collector.num_out_of_order >= 1
        assert life.history == [RequestState.QUEUED, RequestState.ROUTED, RequestState.DECODING,
                                RequestState.FINISHED]
        for pub in (prefill, decode):
            pub.close()
        await collector.close()

    asyncio.run(run())


def test_a_lost_middle_delta_is_an_error_not_a_short_answer() -> None:
    """The final delta came, a middle one never did (its offset is missing): the
    client gets StreamLostError, not a shorter answer that looks finished."""

    async def run() -> None:
        collector = TokenStreamCollector(final_grace_s=0.2)
        collector.open("r", [1, 2], 10.0)
        pub = TokenStreamPublisher("w")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        consumer = asyncio.ensure_future(_consume(collector, "r", done))
        pub.add(collector.address, output("r", [5], "a"), 0)
        pub.add(collector.address, output("r", [7], "c", "length"), 2)  # offset 1 was lost on the way
        pub.flush()
        done.set_result(None)
        with pytest.raises(StreamLostError):
            await consumer
        pub.close()
        await collector.close()

    asyncio.run(run())


@pytest.mark.parametrize("again", [[9], [5, 6]], ids=["another-token", "more-than-handed-on"])
def test_a_repeat_that_differs_from_what_the_client_has_breaks_the_try(again: list[int]) -> None:
    """The prefill worker published token 0 and lost its KV; the decode worker prefilled
    the prompt itself and drew another first token (unseeded sampling). Passing on the
    rest would answer inconsistently; dropping it silently too: the try breaks, and
    the next one resumes from the token the client has."""

    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("r", [1, 2], 10.0)
        prefill, decode = TokenStreamPublisher("p"), TokenStreamPublisher("d")
        call: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the decode worker's
        try_ = asyncio.ensure_future(collector.watch("r", call))
        prefill.add(collector.address, output("r", [5], "a"), 0)
        prefill.flush()
        await asyncio.sleep(0.2)
        decode.add(collector.address, output("r", again, "z" * len(again)), 0)
        decode.add(collector.address, output("r", [7], "c", "length"), len(again))
        decode.flush()
        with pytest.raises(StreamLostError):
            await asyncio.wait_for(try_, 5.0)
        assert collector.num_diverged == 1
        retry = collector.next_attempt("r")
        assert retry.resume is not None and retry.resume.token_ids == (5,) and retry.resume.text_chars == 1
        for pub in (prefill, decode):
            pub.close()
        await collector.close()

    asyncio.run(run())



def test_a_final_delta_the_deadline_cuts_short_is_a_timeout() -> None:
    """The worker's call returned, and its final delta is still missing when the request's
    deadline passes (before the grace for it would): the request timed out, the one way
    every path reports it."""

    async def run() -> None:
        collector = TokenStreamCollector(final_grace_s=5.0)
        life = collector.open("a", [1], 0.3)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="passed its deadline"):
            await _consume(collector, "a", done)
        assert time.monotonic() - t < 2.0 and life.exit is Exit.DEADLINE
        await collector.close()

    asyncio.run(run())


def test_tries_that_return_before_the_final_delta_are_an_error_not_a_hang() -> None:
    """`consume`'s contract: its tries return only once every token was handed on (each
    try awaited through `watch`). A bare call that returns early ends the stream at once."""

    async def run() -> None:
        collector = TokenStreamCollector()
        life = collector.open("a", [1], 10.0)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        with pytest.raises(RuntimeError, match="before its final delta"):
            async with asyncio.timeout(2.0):
                _ = [o async for o in collector.consume("a", done)]
        assert life.exit is Exit.PEER_FAILED
        await collector.close()

    asyncio.run(run())


@pytest.mark.parametrize(("interval", "chunks"), [
    (1, [[10], [11], [12], [13], [14], [15], [16], [17], [18], [19]]),  # each token as it comes
    (4, [[10], [11, 12, 13, 14], [15, 16, 17, 18], [19]]),  # the first at once, then 4, the final one early
    (64, [[10], [11, 12, 13, 14, 15, 16, 17, 18, 19]]),
])
def test_a_stream_interval_gathers_tokens_into_fewer_chunks_and_loses_none(interval: int,
                                                                          chunks: list[list[int]]) -> None:
    """A worker sends one token a step; with --stream-interval N the reader yields the first
    token at once (time to first token unchanged), then N at a time, and the final delta as
    soon as it comes: the same tokens and text, in order, in fewer chunks."""

    async def run() -> list[RequestOutput]:
        collector = TokenStreamCollector(stream_interval=interval)
        collector.open("r", [1, 2], 10.0)
        worker = TokenStreamPublisher("w")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        consumer = asyncio.ensure_future(_consume(collector, "r", done))
        for i in range(10):
            finish = "length" if i == 9 else None
            if finish:
                done.set_result(None)  # the worker's call returns as it sends its last token
            worker.add(collector.address, output("r", [10 + i], chr(97 + i), finish), i)
            worker.flush()
            await asyncio.sleep(0.02)  # a step: the reader is never behind
        outs = await asyncio.wait_for(consumer, 10)
        worker.close()
        await collector.close()
        return outs

    outs = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outs] == chunks
    assert "".join(o.outputs[0].text for o in outs) == "abcdefghij"
    assert [o.finished for o in outs] == [False] * (len(chunks) - 1) + [True]


def test_a_stream_interval_below_one_is_refused() -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="stream_interval"):
            TokenStreamCollector(stream_interval=0)

    asyncio.run(run())
