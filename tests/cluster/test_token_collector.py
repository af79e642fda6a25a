"""The gateway's token collector (cluster/token_collector.py): deltas put back in order,
a broken or short stream is an error and never a shorter answer, and `watch` ends a try
on its call's error, a broken stream, a final delta that never came, or the deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

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


class _Workers:
    """Signed batches as any worker would send them, each worker's numbered by the test
    (a number skipped is a batch lost on the way)."""

    def __init__(self, collector: TokenStreamCollector) -> None:
        self.address = collector.address
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.connect(collector.address)

    def send(self, worker: str, seq: int, *deltas: TokenDelta) -> None:
        body = encode(TokenDeltaBatch(worker_id=worker, seq=seq, deltas=deltas))
        self.sock.send_multipart([auth.token_tag(auth.default_secret(), self.address, body), body])

    def close(self) -> None:
        self.sock.close(linger=0)


def _delta(rid: str, offset: int, token: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(rid, offset, (token,), "t", finish, None, None, 0, None, None)


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("gap_first", [False, True], ids=["held-then-gap", "gap-then-held"])
def test_a_lost_batch_with_a_tries_first_delta_from_a_worker_breaks_the_try_at_once(gap_first: bool) -> None:
    """After a handoff the prefill worker's one delta for a request (its first token) is
    in a batch lost on the way, so the request names no sender there. The decode
    worker's deltas wait for that token, which will never come. When the prefill
    worker's next batch shows the gap (before or after those deltas arrive), the try
    breaks at once, not when the decode worker has generated the whole answer."""

    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("r", [1, 2], 30.0)
        workers = _Workers(collector)
        call: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the decode worker at work
        consumer = asyncio.ensure_future(_consume(collector, "r", call))
        workers.send("p", 0, _delta("other", 0, 9))
        await _until(lambda: collector._next_seq.get("p") == 1)
        # p's batch 1, with r's first token, is lost.
        if gap_first:
            workers.send("p", 2, _delta("other", 1, 9))
            await _until(lambda: collector.num_gaps == 1)
        workers.send("d", 0, _delta("r", 1, 6))
        workers.send("d", 1, _delta("r", 2, 7))
        if not gap_first:
            await _until(lambda: collector.num_out_of_order == 2)
            workers.send("p", 2, _delta("other", 1, 9))
        started = time.monotonic()
        with pytest.raises(StreamLostError, match="lost on the way"):
            await asyncio.wait_for(consumer, 5.0)
        assert time.monotonic() - started < 2.0 and call.cancelled()  # given up before it returned
        workers.close()
        await collector.close()

    asyncio.run(run())


def test_a_gap_after_a_tries_final_delta_moves_nothing() -> None:
    """A worker's batch went missing after it sent a request's final delta (the same drain
    can take both): nothing of that request was lost, so its try's watch waits for the
    call to return, as for any finished try. Raising StreamLostError would move it: the
    backend would start it again on another worker for a client that has its answer
    (its reader ends as finished and aborts nothing)."""

    async def run() -> None:
        collector = TokenStreamCollector()
        collector.open("r", [1, 2], 30.0)
        workers = _Workers(collector)
        call: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(collector.watch("r", call))  # the backend's tries: the reader apart
        workers.send("w", 0, _delta("r", 0, 5), _delta("r", 1, 6, "length"))
        workers.send("w", 2, _delta("other", 0, 9))  # batch 1 lost
        await _until(lambda: collector.num_gaps == 1 and collector.finished("r").is_set())
        await asyncio.sleep(0.05)
        assert not watch.done(), watch
        call.set_result(None)  # the worker's call returns after its final delta
        await asyncio.wait_for(watch, 5.0)
        workers.close()
        await collector.close()

    asyncio.run(run())
