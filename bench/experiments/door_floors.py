"""What the gateway's stack costs before any pdserve code runs (issue 47's per-token bar).

Two floors, each measured as the CPU of the receiving process divided by what it handled:

- `receive`: one message every `--step-ms` from a publisher process, received by a ZeroMQ PULL
  socket three ways (pyzmq's asyncio socket; a plain socket drained from the loop's reader on its
  FD, as cluster/token_collector.py does; blocking recv in a plain loop) and, beside them, a raw
  TCP socket on the same loop (uvloop). It shows what a wake costs per message on this machine.
- `http`: uvicorn (uvloop, httptools) streaming `--tokens` SSE chunks a request, one every
  `--step-ms`, to `--concurrency` aiohttp streams from another process: a bare ASGI app, and
  FastAPI returning a StreamingResponse. Server CPU per chunk: the per-chunk floor of a gateway
  that writes one token a chunk through uvicorn.
- `ray call` (`--ray-calls N`, 0 to skip): what one Ray actor call costs, the way the gateway
  started every request on its worker until it used the workers' inboxes
  (`serve.remote(ServeRequest)`; cluster/worker_inbox.py now): N calls, at most
  `--concurrency` in flight, to an async actor that returns at once; CPU per call of the caller
  (this process, its Ray threads included) and of the actor's process. A per-request floor.

    python bench/experiments/door_floors.py [--rounds 2] [--step-ms 5] [--ray-calls 3000]
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import cpu_name  # noqa: E402

MESSAGES = 400
CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":" hello","logprobs":null,"finish_reason":null}]}\n\n')


# -- receive ----------------------------------------------------------------------------------


def _push(address: str, step_s: float) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(address)
    time.sleep(0.5)
    for _ in range(MESSAGES):
        s.send_multipart([b"m" * 32, b"p" * 200])
        time.sleep(step_s)
    time.sleep(0.3)
    s.close(linger=1000)
    ctx.term()


def _push_tcp(port: int, step_s: float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        time.sleep(0.5)
        for _ in range(MESSAGES):
            s.sendall(b"p" * 232)
            time.sleep(step_s)


def _timed(target: Any, arg: Any, step_s: float) -> "tuple[mp.process.BaseProcess, float]":
    p = mp.get_context("spawn").Process(target=target, args=(arg, step_s))
    p.start()
    return p, time.process_time()


async def _zmq_asyncio(step_s: float) -> float:
    import zmq.asyncio

    s = zmq.asyncio.Context.instance().socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    p, c0 = _timed(_push, f"tcp://127.0.0.1:{port}", step_s)
    await s.recv_multipart()
    c0 = time.process_time()
    for _ in range(MESSAGES - 1):
        await s.recv_multipart()
    cpu = time.process_time() - c0
    p.join()
    s.close(0)
    return cpu / (MESSAGES - 1)


async def _zmq_drained(step_s: float) -> float:
    import zmq

    s = zmq.Context.instance().socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    loop = asyncio.get_running_loop()
    got, c0 = 0, 0.0
    done: asyncio.Future[None] = loop.create_future()

    def drain() -> None:
        nonlocal got, c0
        while int(s.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # type: ignore[arg-type]
            s.recv_multipart(zmq.NOBLOCK)
            got += 1
            if got == 1:
                c0 = time.process_time()
        if got >= MESSAGES and not done.done():
            done.set_result(None)

    loop.add_reader(s.fileno(), drain)
    p, _ = _timed(_push, f"tcp://127.0.0.1:{port}", step_s)
    await done
    cpu = time.process_time() - c0
    loop.remove_reader(s.fileno())
    p.join()
    s.close(0)
    return cpu / (MESSAGES - 1)


def _zmq_blocking(step_s: float) -> float:
    import zmq

    s = zmq.Context.instance().socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    p, _ = _timed(_push, f"tcp://127.0.0.1:{port}", step_s)
    s.recv_multipart()
    c0 = time.process_time()
    for _ in range(MESSAGES - 1):
        s.recv_multipart()
    cpu = time.process_time() - c0
    p.join()
    s.close(0)
    return cpu / (MESSAGES - 1)


async def _tcp(step_s: float) -> float:
    loop = asyncio.get_running_loop()
    got, c0 = 0, 0.0
    done: asyncio.Future[None] = loop.create_future()

    class Reader(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            nonlocal got, c0
            if got == 0:
                c0 = time.process_time()
            got += len(data)
            if got >= 232 * MESSAGES and not done.done():
                done.set_result(None)

    server = await loop.create_server(Reader, "127.0.0.1", 0)
    p, _ = _timed(_push_tcp, server.sockets[0].getsockname()[1], step_s)
    await done
    cpu = time.process_time() - c0
    server.close()
    p.join()
    return cpu / (MESSAGES - 1)


def receive_floors(step_s: float) -> dict[str, float]:
    import uvloop

    return {
        "zmq.asyncio socket (uvloop)": uvloop.run(_zmq_asyncio(step_s)),
        "zmq socket drained on its FD (uvloop)": uvloop.run(_zmq_drained(step_s)),
        "zmq blocking recv": _zmq_blocking(step_s),
        "raw TCP, asyncio Protocol (uvloop)": uvloop.run(_tcp(step_s)),
    }


# -- http -------------------------------------------------------------------------------------


async def _chunks(n: int, step_s: float) -> AsyncIterator[bytes]:
    for _ in range(n):
        await asyncio.sleep(step_s)
        yield CHUNK
    yield b"data: [DONE]\n\n"


def _server(kind: str, port: int, tokens: int, step_s: float) -> None:
    import uvicorn

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for c in _chunks(tokens, step_s):
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app: Any = bare
    if kind == "fastapi":
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse
        from starlette.requests import Request

        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:  # (FastAPI reads this signature)
            await request.json()
            return StreamingResponse(_chunks(tokens, step_s), media_type="text/event-stream")


    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")


async def _load(port: int, concurrency: int, requests: int) -> int:
    import aiohttp

    chunks = 0
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one() -> None:
            nonlocal chunks
            async with gate, s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}) as r:
                async for line in r.content:
                    chunks += line.startswith(b"data: {")
        await asyncio.gather(*(one() for _ in range(requests)))
    return chunks


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_floor(kind: str, a: argparse.Namespace) -> tuple[float, float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port),
                               "--tokens", str(a.tokens), "--step-ms", str(a.step_ms)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: the server did not start") from None
                time.sleep(0.1)
        asyncio.run(_load(port, a.concurrency, a.concurrency * 2))  # warm up
        c0, t0 = _cpu_s(server.pid), time.monotonic()
        chunks = asyncio.run(_load(port, a.concurrency, a.requests))
        cpu, wall = _cpu_s(server.pid) - c0, time.monotonic() - t0
    finally:
        server.terminate()
        server.wait(10)
    if chunks != a.requests * a.tokens:
        raise SystemExit(f"{kind}: {chunks} chunks, expected {a.requests * a.tokens}")
    return cpu / chunks, chunks / wall


def ray_call_floor(calls: int, concurrency: int) -> tuple[float, float]:
    """Seconds of CPU a call: (caller, actor), over `calls` calls to a local actor."""
    import ray

    from pdserve.workers.handoff import ServeRequest
    from pdserve.workers.sampling_params import SamplingParams

    @ray.remote
    class Sink:
        async def serve(self, req: Any) -> None:
            return None

        def cpu_s(self) -> float:
            t = os.times()
            return t.user + t.system

    sink = Sink.remote()  # type: ignore[attr-defined]
    req = ServeRequest("cmpl-" + "0" * 32, tuple(range(20)), SamplingParams(max_tokens=64, ignore_eos=True), 600.0,
                       "tcp://127.0.0.1:5555")

    async def load() -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                await sink.serve.remote(req)

        await asyncio.gather(*(one() for _ in range(calls)))

    asyncio.run(load())  # warm-up
    actor0, caller0 = ray.get(sink.cpu_s.remote()), time.process_time()
    asyncio.run(load())
    caller, actor = time.process_time() - caller0, ray.get(sink.cpu_s.remote()) - actor0
    ray.kill(sink)
    return caller / calls, actor / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--ray-calls", type=int, default=3000, help="Ray actor calls a round (0: no Ray floor)")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        _server(a.serve, a.port, a.tokens, a.step_ms / 1e3)
        return
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; step {a.step_ms:g} ms, {a.rounds} rounds (alternating)")
    recv: dict[str, list[float]] = {}
    http: dict[str, list[tuple[float, float]]] = {}
    calls: list[tuple[float, float]] = []
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds} ...", file=sys.stderr, flush=True)
        for name, v in receive_floors(a.step_ms / 1e3).items():
            recv.setdefault(name, []).append(v * 1e6)
        for kind in ("bare ASGI", "fastapi"):
            cpu, rate = http_floor("fastapi" if kind == "fastapi" else "bare", a)
            http.setdefault(kind, []).append((cpu * 1e6, rate))
    if a.ray_calls:  # after the others: Ray's threads and processes would be their neighbours
        import ray

        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
        for _ in range(a.rounds):
            caller, actor = ray_call_floor(a.ray_calls, a.concurrency)
            calls.append((caller * 1e6, actor * 1e6))
        ray.shutdown()
    print(f"\n| receive, one message every {a.step_ms:g} ms | us of CPU a message (median) | rounds |")
    print("|---|---:|---|")
    for name, vs in recv.items():
        print(f"| {name} | {statistics.median(vs):.0f} | {', '.join(f'{v:.0f}' for v in vs)} |")
    print(f"\n| uvicorn, c{a.concurrency} SSE, one chunk every {a.step_ms:g} ms a stream | server us of CPU a chunk "
          "(median) | chunks/s | rounds |")
    print("|---|---:|---:|---|")
    for kind, vs in http.items():
        print(f"| {kind} | {statistics.median(c for c, _ in vs):.1f} | {statistics.median(r for _, r in vs):.0f} | "
              f"{', '.join(f'{c:.1f}' for c, _ in vs)} |")
    if calls:
        print(f"\n| a Ray actor call (a ServeRequest, c{a.concurrency}, {a.ray_calls} a round) | us of CPU a call "
              "(median) | rounds |")
        print("|---|---:|---|")
        for i, who in enumerate(("the caller", "the actor")):
            rounds = ", ".join(f"{c[i]:.0f}" for c in calls)
            print(f"| {who} | {statistics.median(c[i] for c in calls):.0f} | {rounds} |")


if __name__ == "__main__":
    main()
