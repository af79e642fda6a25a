"""CPU per token of the gateway's token-stream receive path alone: a publisher process sends
steps of one-token deltas for `streams` requests over the real token stream (ZeroMQ, signed);
here a TokenStreamCollector hands them to one reader per request (uvloop, as in a gateway
replica). Prints this process's CPU per token and per output the readers got: at `--step-ms 0`
the readers fall behind and take many deltas as one output.

    python bench/token_receive.py [--streams 16] [--tokens 400] [--step-ms 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

from machine import cpu_name


def _publish(address: str, rids: list[str], key_hex: str, tokens: int, step_s: float) -> None:
    from pdserve.workers.outputs import CompletionOutput, RequestOutput
    from pdserve.workers.token_stream import TokenStreamPublisher
    from pdserve.workers.transfer.auth import ClusterSecret

    pub = TokenStreamPublisher("bench", secret=ClusterSecret(bytes.fromhex(key_hex)))
    pub.watch(address)
    time.sleep(0.5)
    for k in range(tokens):
        t0 = time.monotonic()
        finish = "length" if k == tokens - 1 else None
        for rid in rids:
            c = CompletionOutput(0, " tok", [42], None, None, finish, None)
            pub.add(address, RequestOutput(rid, None, [1], [c], finish is not None, 0, {}, None), k)
        pub.flush()
        time.sleep(max(0.0, step_s - (time.monotonic() - t0)))
    time.sleep(0.5)
    pub.close()


async def _run(streams: int, tokens: int, step_s: float) -> tuple[float, float]:
    from pdserve.cluster.token_collector import TokenStreamCollector
    from pdserve.workers.transfer.auth import ClusterSecret

    key = os.urandom(32)
    collector = TokenStreamCollector(secret=ClusterSecret(key))
    rids = [f"cmpl-{i:032x}" for i in range(streams)]
    outputs = 0
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def call() -> None:
        await done

    async def read(rid: str) -> None:
        nonlocal outputs
        collector.open(rid, [1], 600)
        async for out in collector.consume(rid, collector.watch(rid, call())):
            outputs += 1
            if out.finished:
                return

    readers = [asyncio.create_task(read(r)) for r in rids]
    publisher = mp.get_context("spawn").Process(target=_publish, args=(collector.address, rids, key.hex(), tokens,
                                                                        step_s))
    cpu0 = time.process_time()
    publisher.start()
    deadline = time.monotonic() + 60 + tokens * step_s * 2
    while not all(r.done() for r in readers) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = time.process_time() - cpu0
    if not done.done():  # cancelled with the tries once a reader took its final delta
        done.set_result(None)
    await asyncio.gather(*readers, return_exceptions=True)
    publisher.join(30)
    await collector.close()
    if not all(r.done() and r.exception() is None for r in readers):
        raise SystemExit("a reader did not finish")
    return cpu / (streams * tokens) * 1e6, cpu / max(outputs, 1) * 1e6


def main() -> None:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    runs = [uvloop.run(_run(a.streams, a.tokens, a.step_ms / 1e3)) for _ in range(a.repeats)]
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores")
    print(f"{a.streams} streams x {a.tokens} tokens, step {a.step_ms:g} ms; runs (us/token, us/output): "
          + ", ".join(f"{t:.1f}/{o:.1f}" for t, o in runs))
    print(f"median: {statistics.median(t for t, _ in runs):.1f} us of CPU per token")


if __name__ == "__main__":
    main()
