"""Token deltas from a worker's engine thread to the gateway over ZeroMQ, batched per step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.cluster.token_collector import TokenStreamCollector
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.handoff import ServeRequest
from pdserve.workers.messages import TokenDeltaBatch, encode, encode_token_deltas
from pdserve.workers.outputs import CompletionOutput, RequestOutput
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.token_stream import (
    StreamLostError,
    TokenStreamPublisher,
    from_delta,
    to_delta,
    wire_delta,
)


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


def output(rid: str, tokens: list[int], text: str, finish: str | None = None, logprobs: bool = False) -> RequestOutput:
    lps = [{t: -0.5, t + 1: -1.25} for t in tokens] if logprobs else None
    c = CompletionOutput(0, text, tokens, -0.5 * len(tokens) if logprobs else None, lps, finish,
                         7 if finish == "stop" else None)
    return RequestOutput(rid, None, [1, 2, 3], [c], finish is not None, num_cached_tokens=16)


def with_prompt_logprobs(out: RequestOutput) -> RequestOutput:
    out.prompt_logprobs = [None, {2: -0.75, 9: -0.5}, {3: -2.0}]
    return out


@pytest.mark.parametrize("out", [output("a", [5, 6], "xy"), output("b", [9], "z", "stop", logprobs=True),
                                 output("c", [], "", "abort"), with_prompt_logprobs(output("d", [4], "w"))])
def test_a_delta_survives_the_wire(out: RequestOutput) -> None:
    assert from_delta(to_delta(out, 3), [1, 2, 3]) == out


@pytest.mark.parametrize("out", [output("a", [5, 6], "xy"), output("b", [9], "z", "stop", logprobs=True),
                                 output("c", [], "", "abort"), with_prompt_logprobs(output("d", [4], "w")),
                                 output("e", [3], "v", "length")])
def test_the_engine_threads_wire_form_is_the_records_byte_for_byte(out: RequestOutput) -> None:
    # The worker writes deltas straight in their wire form (no record per token); the gateway
    # decodes them as TokenDeltas. Any drift between the two forms shows here.
    out.metrics["queue_time_s"] = 0.25
    out.outputs[0].stop_reason = "##" if out.request_id == "e" else out.outputs[0].stop_reason
    slow = encode(TokenDeltaBatch(worker_id="w#1", seq=7, deltas=(to_delta(out, 3, 2), to_delta(out, 4))))
    assert encode_token_deltas("w#1", 7, [wire_delta(out, 3, 2), wire_delta(out, 4)]) == slow


async def _consume(collector: TokenStreamCollector, rid: str, call: Awaitable[object]) -> list[RequestOutput]:
    """The request's deltas as the gateway reads a lone try of it (no retries)."""
    return [o async for o in collector.consume(rid, collector.watch(rid, call))]


def test_deltas_of_one_step_travel_as_one_message_and_reach_their_own_requests() -> None:
    async def run() -> None:
        collector = TokenStreamCollector()
        pub = TokenStreamPublisher("w0")
        for rid in ("a", "b"):
            collector.open(rid, [1, 2, 3], 10.0)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        consumers = [asyncio.ensure_future(_consume(collector, rid, done)) for rid in ("a", "b")]
        pub.add(collector.address, output("a", [5], "x"), 0)
        pub.add(collector.address, output("b", [8], "p"), 0)
        assert pub.flush() == []
        pub.add(collector.address, output("a", [6], "y", "length"), 1)
        pub.add(collector.address, output("b", [9], "q", "stop"), 1)
        pub.add(collector.address, output("gone", [1], "late"), 0)  # nobody listens: dropped
        pub.flush()
        done.set_result(None)
        a, b = await asyncio.gather(*consumers)
        tokens = lambda outs: [t for o in outs for t in o.outputs[0].token_ids]  # noqa: E731
        assert tokens(a) == [5, 6] and tokens(b) == [8, 9]
        assert a[-1].finished and b[-1].outputs[0].finish_reason == "stop" and b[-1].outputs[0].stop_reason == 7
        pub.close()
        await collector.close()

    asyncio.run(run())


def test_a_burst_of_steps_larger_than_one_drain_all_arrive_in_order() -> None:
    """The collector drains its socket from the loop's reader, a bounded number of messages a
    wake (the FD is edge-triggered): 300 steps sent before the loop reads any of them, more
    than one drain takes, all reach their request, in order, and the loop stays free between
    drains (a timer set before the burst fires before the last step is read)."""

    async def run() -> None:
        collector = TokenStreamCollector()
        pub = TokenStreamPublisher("w0")
        collector.open("a", [1, 2, 3], 10.0)
        steps = 300
        for k in range(steps):
            pub.add(collector.address, output("a", [k], "t", "length" if k == steps - 1 else None), k)
            assert pub.flush() == []
        time.sleep(0.5)  # (blocking: every message is queued on the socket before the loop runs)
        ticks: list[int] = []
        asyncio.get_running_loop().call_soon(lambda: ticks.append(collector._open["a"].next_offset))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        got = await asyncio.wait_for(_consume(collector, "a", _set_after(done)), 10)
        assert [t for o in got for t in o.outputs[0].token_ids] == list(range(steps)) and got[-1].finished
        assert ticks and ticks[0] < steps  # the loop ran between drains
        pub.close()
        await collector.close()

    asyncio.run(run())


async def _set_after(done: asyncio.Future[None]) -> None:
    done.set_result(None)


def test_prompt_logprobs_over_the_message_limit_arrive_in_slices() -> None:
    """A long prompt's logprobs (top-20 for 8,000 tokens: several MiB) do not fit
    one message, which the receiver would refuse whole: they go in slices, in
    order, and the other requests of the same step are not held back."""

    async def run() -> None:
        collector = TokenStreamCollector()
        pub = TokenStreamPublisher("w0")
        for rid in ("big", "small"):
            collector.open(rid, [1, 2, 3], 10.0)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        consumers = [asyncio.ensure_future(_consume(collector, rid, done)) for rid in ("big", "small")]
        big = output("big", [5], "x", "length")
        big.prompt_logprobs = [None] + [{t * 31 + j: -0.1 * j - 0.001 * t for j in range(21)} for t in range(1, 8000)]
        pub.add(collector.address, big, 0)
        pub.add(collector.address, output("small", [8], "p", "stop"), 0)
        assert pub.flush() == []
        assert pub._seq[collector.address] >= 3  # it took several messages
        done.set_result(None)
        got_big, got_small = await asyncio.gather(*consumers)
        # (the collector merges the slices it holds when its consumer is behind)
        assert [t for o in got_big for t in o.outputs[0].token_ids] == [5] and got_big[-1].finished
        assert not any(o.finished for o in got_big[:-1])
        joined = [e for o in got_big if o.prompt_logprobs for e in o.prompt_logprobs]
        assert joined == big.prompt_logprobs
        assert [t for o in got_small for t in o.outputs[0].token_ids] == [8] and got_small[-1].finished
        pub.close()
        await collector.close()

    asyncio.run(run())


def test_engine_streams_to_a_collector_like_it_streams_to_a_caller(model_dir: Path) -> None:
    """The same requests, deltas through ZeroMQ, equal the offline outputs; the
    worker-side call returns only once the final delta is out."""
    llm = LLM(str(model_dir), max_model_len=512, progress=False)
    prompts = [[5 + i, 9, 33, 7 * i + 1, 2] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    expected = llm.generate(prompts, params)
    engine = AsyncEngine(LLM(str(model_dir), max_model_len=512, progress=False).engine, worker_id="w").start()

    async def run() -> list[list[RequestOutput]]:
        collector = TokenStreamCollector()

        async def one(i: int, prompt: list[int]) -> list[RequestOutput]:
            collector.open(f"r{i}", prompt, 30.0)
            req = ServeRequest(f"r{i}", tuple(prompt), params, 30.0, collector.address)
            return await _consume(collector, f"r{i}", engine.serve(req))

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await collector.close()

    got = asyncio.run(run())
    engine.close()
    for outs, ref in zip(got, expected):
        assert [t for o in outs for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
        assert len([lp for o in outs for lp in o.outputs[0].logprobs or []]) == len(ref.outputs[0].token_ids)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert engine.engine.kv.pool.num_used == 0


def test_a_worker_aborts_the_requests_of_a_gateway_that_is_gone(model_dir: Path) -> None:
    """The gateway dies mid-stream (its socket closes), or was never reachable: the
    worker ends those requests after its grace and frees their blocks, instead of
    decoding to the deadline for nobody."""
    import socket

    from pdserve.workers.async_engine import RequestAbortedError

    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"tcp://127.0.0.1:{s.getsockname()[1]}"

    async def run(ae: AsyncEngine) -> list[float]:
        collector = TokenStreamCollector()
        collector.open("live", [5, 6, 7], 60.0)
        t0 = time.monotonic()
        gone = asyncio.ensure_future(ae.serve(ServeRequest("live", (5, 6, 7), params, 60.0, collector.address)))
        never = asyncio.ensure_future(ae.serve(ServeRequest("never", (5, 6, 7), params, 60.0, nowhere)))
        await asyncio.sleep(0.3)
        await collector.close()  # the gateway is gone
        ended = []
        for fut in (gone, never):
            with pytest.raises((StreamLostError, RequestAbortedError), match="gateway is gone"):
                await fut
            ended.append(time.monotonic() - t0)
        return ended

    ae = AsyncEngine(LLM(str(model_dir), max_model_len=1024, num_kv_blocks=256, progress=False).engine)
    ae.on_iteration = lambda: time.sleep(0.005)  # 1000 tokens take >= 5 s: longer than noticing
    ae.gateway_gone_s = 0.5
    with ae:
        ended = asyncio.run(run(ae))
        assert max(ended) < 10.0, ended  # not 1000 tokens' worth, nor the 60 s deadline
        assert ae.num_orphans_aborted == 2 and ae.num_in_flight == 0
        assert ae.engine.kv.pool.num_used == 0 or ae.engine.config.enable_prefix_caching
        assert not ae.engine.has_unfinished_requests()


def test_a_prefill_workers_first_token_sockets_to_gateways_gone_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each gateway a prefill worker sent a first token to kept a socket (and its reconnects)
    for the worker's whole life: replaced replicas' token streams have new ports, so they
    piled up. Those whose link stayed down past the grace are closed as first tokens go."""
    import socket

    from pdserve.workers import prefill_handoff

    monkeypatch.setattr(prefill_handoff, "GATEWAY_GONE_S", 0.2)
    monkeypatch.setattr(prefill_handoff, "GONE_CHECK_S", 0.0)
    ports = []
    for _ in range(3):
        with socket.socket() as s:  # a port nothing listens on: a gateway gone
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    first = prefill_handoff.FirstTokens("p", None)
    try:
        for port in ports:
            first.send(f"tcp://127.0.0.1:{port}", output("r", [5], "a"), 0)
        time.sleep(0.4)
        first.send(f"tcp://127.0.0.1:{ports[0]}", output("r2", [5], "a"), 0)  # the check runs as one goes
        assert len(first._publisher._sockets) <= 1  # only the one just opened again
    finally:
        first.close()


@pytest.mark.parametrize("reply_to", ["tcp://127.0.0.1:notaport", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000",
                                      "ipc:///tmp/x", "127.0.0.1:5555", "tcp://host:5555/extra", ""])
def test_a_reply_to_that_is_no_tcp_endpoint_is_refused(reply_to: str) -> None:
    with pytest.raises(ValueError, match="reply_to: must be tcp://host:port"):
        ServeRequest("r", (1, 2), SamplingParams(), 10.0, reply_to)


def test_one_requests_reply_to_zeromq_refuses_fails_that_request_not_the_engine(model_dir: Path) -> None:
    """A signed start whose reply_to ZeroMQ will not connect to (well formed, but "-bad-" is no
    host name it takes) raised out of the engine thread's command queue: the engine died and
    every request on the worker failed with it. Now that request fails; the next is served."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run(ae: AsyncEngine) -> None:
        with pytest.raises(Exception, match="reply_to 'tcp://-bad-:5555'"):
            await asyncio.wait_for(ae.serve(ServeRequest("bad", (5, 6, 7), params, 30.0, "tcp://-bad-:5555")), 30)
        collector = TokenStreamCollector()
        try:
            collector.open("good", [5, 6, 7], 30.0)
            await asyncio.wait_for(ae.serve(ServeRequest("good", (5, 6, 7), params, 30.0, collector.address)), 30)
        finally:
            await collector.close()

    ae = AsyncEngine(LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, progress=False).engine)
    with ae:
        asyncio.run(run(ae))
        assert ae.healthy and ae.num_in_flight == 0 and not ae.engine.has_unfinished_requests()


def test_a_publisher_that_could_not_connect_keeps_no_link() -> None:
    from pdserve.workers.transfer.auth import ClusterSecret

    pub = TokenStreamPublisher("w", secret=ClusterSecret.generate())
    try:
        with pytest.raises(Exception, match="Invalid argument"):
            pub.watch("tcp://-bad-:5555")
        assert pub.gone(grace_s=0.0) == []  # was a KeyError: a monitor without its socket
        pub.add("tcp://-bad-:5555", output("a", [5], "x"), 0)
        assert pub.flush() == ["a"]  # its request is lost, the publisher goes on
    finally:
        pub.close()


def test_a_gateway_whose_link_came_up_before_its_monitor_was_made_is_not_taken_for_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher connected, then made the socket's monitor: a handshake done in between (the
    worker's thread descheduled a moment, on a busy or cold machine) was never reported, the link
    looked never up, and after the grace every request of a live gateway was aborted ("its
    gateway is gone": the first wave of a benchmark's streams, once). The monitor comes first now."""
    import zmq

    from pdserve.workers import token_stream

    real = token_stream.LinkMonitor

    def late_monitor(sock: zmq.Socket[bytes]) -> object:
        time.sleep(0.3)  # long enough for a loopback handshake already under way to finish
        return real(sock)

    monkeypatch.setattr(token_stream, "LinkMonitor", late_monitor)
    gateway = zmq.Context.instance().socket(zmq.PULL)
    port = gateway.bind_to_random_port("tcp://127.0.0.1")
    publisher = TokenStreamPublisher("w")
    try:
        publisher.watch(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)
        assert publisher.gone(grace_s=0.2) == []
    finally:
        publisher.close()
        gateway.close(linger=0)
